"""Transport security: mTLS on every hop and the gateway's bearer token, on a real E+PD stack.

The stack (one encoder, one combined decode, one gateway) requires client certificates on
every service, and the gateway also requires a token. The certificates come from a CA made
here. Every test uses ``family_stack`` so that this module runs with the other Qwen2.5-VL tests
(see ``pytest_collection_modifyitems``); its monolithic gateway is the oracle.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import pathlib
import subprocess
import sys

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cli.launcher import Stack, gateway_args
from devkit.media import synthetic_image_png
from epd.client import chat_request, generate, open_channel
from epd.security import TlsConfig, channel_credentials
from epd.v1 import decode_pb2, decode_pb2_grpc, encoder_pb2, encoder_pb2_grpc, gateway_pb2, gateway_pb2_grpc, multimodal_pb2
from tests.conftest import checkpoint
from tests.helpers import MIN_TOKENS, SMALL_KV_CACHE

pytestmark = pytest.mark.usefixtures("family_stack")

TOKEN = "s3cret-token-for-tests"
SERVING = health_pb2.HealthCheckResponse.SERVING
GATEWAYS = ["gateway"]


# --- certificates -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Pem:
    cert: pathlib.Path
    key: pathlib.Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _issue(folder: pathlib.Path, name: str, *, issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None) -> tuple[Pem, x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A CA (``issuer`` None: self-signed) or a leaf for 127.0.0.1 and localhost, usable as both
    server and client certificate."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )
    if issuer is None:
        signer_cert, signer_key = None, key
        builder = builder.issuer_name(_name(name)).add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        builder = builder.add_extension(
            x509.KeyUsage(False, False, False, False, False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False), critical=True
        )
    else:
        signer_cert, signer_key = issuer
        builder = (
            builder.issuer_name(signer_cert.subject)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(signer_key.public_key()), critical=False)
        )
    cert = builder.sign(signer_key, hashes.SHA256())
    pem = Pem(folder / f"{name}.crt", folder / f"{name}.key")
    pem.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem.key.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return pem, cert, key


@dataclasses.dataclass(frozen=True)
class Pki:
    ca: Pem
    service: Pem  # every service's identity (server and client certificate)
    client: Pem  # the test's client certificate, from the same CA
    rogue_ca: Pem  # a CA no service trusts
    rogue_client: Pem  # a client certificate from it
    token_file: pathlib.Path

    def service_flags(self) -> list[str]:
        return ["--tls-cert", str(self.service.cert), "--tls-key", str(self.service.key), "--tls-ca", str(self.ca.cert), "--require-client-cert"]


def _make_pki(folder: pathlib.Path) -> Pki:
    ca, ca_cert, ca_key = _issue(folder, "ca", issuer=None)
    rogue_ca, rogue_cert, rogue_key = _issue(folder, "rogue-ca", issuer=None)
    token_file = folder / "token"
    token_file.write_text(TOKEN + "\n")  # the trailing newline an editor leaves is ignored
    return Pki(
        ca=ca,
        service=_issue(folder, "service", issuer=(ca_cert, ca_key))[0],
        client=_issue(folder, "client", issuer=(ca_cert, ca_key))[0],
        rogue_ca=rogue_ca,
        rogue_client=_issue(folder, "rogue-client", issuer=(rogue_cert, rogue_key))[0],
        token_file=token_file,
    )


# --- the stack ----------------------------------------------------------------------------


@dataclasses.dataclass
class SecureStack:
    pki: Pki
    addresses: dict[str, str]  # encoder, combined, gateway

    def channel(self, name: str, *, client: Pem | None = None, ca: Pem | None = None, token: str | None = None) -> grpc.aio.Channel:
        tls = TlsConfig(tls_ca=str((ca or self.pki.ca).cert), tls_cert=str(client.cert) if client else "", tls_key=str(client.key) if client else "")
        return open_channel(self.addresses[name], channel_credentials(tls, token=token))


@pytest.fixture(scope="module")
def secure_stack(tmp_path_factory):
    """Encoder, combined decode and an E+PD gateway, each requiring mTLS; the gateway a token too."""
    folder = tmp_path_factory.mktemp("pki")
    pki = _make_pki(folder)
    model = str(checkpoint("qwen2_5_vl"))
    tls = pki.service_flags()
    stack = Stack(tmp_path_factory.mktemp("secure-logs"))
    try:
        # Consumers dial the encoder by the name its certificate covers, as in a StatefulSet.
        # The stages answer only the services' identity (the gateway's, and the consumers' at the
        # encoder), never a gateway client's, whose certificate the same CA signed.
        stage = [*tls, "--allowed-peers", "service"]
        encoder = stack.start("encoder", ["encoder", "--model", model, "--advertise-host", "localhost", *stage])
        combined = stack.start("combined", ["decode", "--model", model, "--mode", "combined", *SMALL_KV_CACHE, *stage])
        stack.wait_ready([encoder, combined], timeout=600)
        extra = [*tls, "--auth-token-file", str(pki.token_file)]
        gateways = {"gateway": stack.start("gateway", gateway_args(model, "epd-combined", encoders=[encoder.address], decodes=[combined.address], extra=extra))}
        stack.wait_ready(list(gateways.values()), timeout=300)
        yield SecureStack(pki, {"encoder": encoder.address, "combined": combined.address, **{name: g.address for name, g in gateways.items()}})
    finally:
        stack.stop()


def _image_request(max_tokens: int = 20) -> gateway_pb2.GenerateRequest:
    return chat_request([(synthetic_image_png(160, 120, seed=81), "image/png"), "Describe this image."], max_tokens=max_tokens, min_tokens=MIN_TOKENS)


async def _health(channel: grpc.aio.Channel, service: str = "") -> int:
    response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
    return response.status


# --- the tests ----------------------------------------------------------------------------


@pytest.mark.parametrize("gateway", GATEWAYS)
async def test_mtls_and_token_stream_the_monolithic_tokens(secure_stack, family_stack, gateway):
    """Client -> gateway (TLS, client certificate, token) -> encoder and combined decode (mTLS
    with the gateway's certificate): the same greedy tokens as the monolithic vLLM run."""
    request = _image_request()
    oracle = await generate(family_stack.gateway_stub("monolithic"), request, timeout=180)
    async with secure_stack.channel(gateway, client=secure_stack.pki.client, token=TOKEN) as channel:
        result = await generate(gateway_pb2_grpc.GatewayServiceStub(channel), request, timeout=180)
    assert len(oracle.token_ids) >= MIN_TOKENS
    assert result.token_ids == oracle.token_ids
    assert result.text == oracle.text
    assert result.finished.usage.prompt_tokens == oracle.finished.usage.prompt_tokens
    assert result.finished.usage.multimodal_tokens == oracle.finished.usage.multimodal_tokens > 0
    # Its locations name the encoder by its advertised host: the combined decode fetched the
    # NIXL metadata from there, over mTLS that verified that name (the certificate covers it).
    # (Asked as a service: the encoder takes no client's certificate.)
    async with secure_stack.channel("encoder", client=secure_stack.pki.service) as channel:
        stub = encoder_pb2_grpc.EncoderServiceStub(channel)
        item = multimodal_pb2.MediaItem(image=multimodal_pb2.Media(data=synthetic_image_png(112, 112, seed=83), mime_type="image/png"))
        location = (await stub.Encode(encoder_pb2.EncodeRequest(items=[item]), timeout=60)).items[0].embedding.nixl
        await stub.ReleaseEmbeddings(encoder_pb2.ReleaseEmbeddingsRequest(lease_ids=[location.lease_id]), timeout=10)
    assert location.encoder_address == f"localhost:{secure_stack.addresses['encoder'].rpartition(':')[2]}"


@pytest.mark.parametrize("gateway", GATEWAYS)
async def test_epd_generate_cli_speaks_mtls_with_a_token(secure_stack, family_stack, tmp_path, gateway):
    png = tmp_path / "image.png"
    png.write_bytes(synthetic_image_png(120, 96, seed=82))
    request = chat_request([(png.read_bytes(), "image/png"), "What is this?"], max_tokens=8)
    oracle = await generate(family_stack.gateway_stub("monolithic"), request, timeout=180)
    pki = secure_stack.pki
    tls = ["--tls-ca", str(pki.ca.cert), "--tls-cert", str(pki.client.cert), "--tls-key", str(pki.client.key)]
    command = [sys.executable, "-m", "cli", "generate", "--gateway", secure_stack.addresses[gateway], "--media", str(png), "--max-tokens", "8"]
    run = subprocess.run([*command, *tls, "--auth-token-file", str(pki.token_file), "What is this?"], capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(oracle.text + "\n[finish=")
    assert f"completion_tokens={len(oracle.token_ids)} " in run.stdout
    # Without the token the same client is refused, and says why.
    refused = subprocess.run([*command, *tls, "What is this?"], capture_output=True, text=True, timeout=180)
    assert refused.returncode == 1
    assert "error: UNAUTHENTICATED: missing 'authorization: Bearer <token>' metadata" in refused.stderr


@pytest.mark.parametrize("name", ["encoder", "combined", *GATEWAYS])
async def test_a_plaintext_client_is_refused_at_connect(secure_stack, name):
    async with open_channel(secure_stack.addresses[name]) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _health(channel)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    # Refused, not dead: a dead service answers UNAVAILABLE too, so the same address must serve
    # a client that speaks mTLS.
    async with secure_stack.channel(name, client=secure_stack.pki.client) as channel:
        assert await _health(channel) == SERVING


@pytest.mark.parametrize("name", ["encoder", "combined", *GATEWAYS])
async def test_client_certificates_are_required_and_verified(secure_stack, name):
    """Only a certificate from the services' CA gets through; one from another CA, or none, is
    refused in the handshake."""
    pki = secure_stack.pki
    async with secure_stack.channel(name, client=pki.client) as channel:
        assert await _health(channel) == SERVING
    for client in (pki.rogue_client, None):
        async with secure_stack.channel(name, client=client) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _health(channel)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, client


async def test_a_gateway_clients_certificate_opens_no_stage(secure_stack):
    """A client certificate the gateway accepts (the same CA signs it) is PERMISSION_DENIED at
    every stage method: the stages take only the identities configured for them. Probes still
    reach health, and the services' own identity is let in (its malformed call is refused on
    its merits)."""
    pki = secure_stack.pki
    encoder = encoder_pb2_grpc.EncoderServiceStub
    decode = decode_pb2_grpc.DecodeServiceStub
    calls = {
        "encoder": [
            lambda ch: encoder(ch).Encode(encoder_pb2.EncodeRequest(request_id="x"), timeout=10),
            lambda ch: encoder(ch).GetTransferMetadata(encoder_pb2.GetTransferMetadataRequest(), timeout=10),
            lambda ch: encoder(ch).ReleaseEmbeddings(encoder_pb2.ReleaseEmbeddingsRequest(release_keys=["k"]), timeout=10),
        ],
        "combined": [
            lambda ch: _first(decode(ch).Decode(decode_pb2.DecodeRequest(request_id="x"), timeout=10)),
            lambda ch: decode(ch).ReleaseKv(decode_pb2.ReleaseKvRequest(request_id="x"), timeout=10),
        ],
    }
    for name, methods in calls.items():
        async with secure_stack.channel(name, client=pki.client) as channel:
            assert await _health(channel) == SERVING
            for call in methods:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call(channel)
                assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, (name, refused.value.details())
        async with secure_stack.channel(name, client=pki.service) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as answered:
                await methods[0](channel)
            assert answered.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, answered.value.details())


async def _first(stream):
    async for response in stream:
        return response


async def test_a_server_from_an_unknown_ca_is_refused(secure_stack):
    """The client side verifies too: trusting only another CA, the handshake fails."""
    pki = secure_stack.pki
    async with secure_stack.channel("encoder", client=pki.client, ca=pki.rogue_ca) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _health(channel)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    async with secure_stack.channel("encoder", client=pki.client) as channel:  # alive: trusting its CA works
        assert await _health(channel) == SERVING


@pytest.mark.parametrize(
    ("token", "message"),
    [(None, "missing 'authorization: Bearer <token>' metadata"), ("wrong-token", "invalid bearer token"), (TOKEN + "x", "invalid bearer token")],
)
@pytest.mark.parametrize("gateway", GATEWAYS)
async def test_a_missing_or_wrong_token_is_unauthenticated(secure_stack, token, message, gateway):
    async with secure_stack.channel(gateway, client=secure_stack.pki.client, token=token) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as streaming:
            await generate(stub, _image_request(max_tokens=4), timeout=30)
        with pytest.raises(grpc.aio.AioRpcError) as unary:
            await stub.Abort(gateway_pb2.AbortRequest(request_id="anything"), timeout=30)
    for refused in (streaming.value, unary.value):
        assert refused.code() == grpc.StatusCode.UNAUTHENTICATED
        assert refused.details() == message


@pytest.mark.parametrize("gateway", GATEWAYS)
async def test_health_and_reflection_need_no_token(secure_stack, gateway):
    async with secure_stack.channel(gateway, client=secure_stack.pki.client) as channel:
        assert await _health(channel) == SERVING
        assert await _health(channel, "epd.v1.GatewayService") == SERVING

        async def list_services():
            yield reflection_pb2.ServerReflectionRequest(list_services="")

        responses = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(list_services(), timeout=10)
        response = await responses.read()
        assert "epd.v1.GatewayService" in {s.name for s in response.list_services_response.service}
