"""The OpenAI-compatible HTTP front (``epd gateway --http-port``).

First the pure parts, with no network: the SSRF guard of remote media (address classes, the
allow list, redirects, DNS answers, sizes; a fake resolver and httpx's MockTransport stand in
for DNS and servers, and the one real lookup is of ``localhost``), the JSON <-> domain
conversion, and the error mapping. Then a real E+PD stack (an encoder, a combined decode and
a gateway with an HTTP port and a bearer token), driven by the official ``openai`` client and
raw HTTP: the tokens equal the gRPC path's for the same chat, streamed or not.

The stack is this module's own (two engines), not ``family_stack`` (five): it runs before the
family stacks in a full run, and alongside nothing.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import datetime
import ipaddress
import ssl
import time
from collections.abc import Callable

import grpc
import httpx
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from cli.launcher import ServiceProcess, gateway_args
from devkit.media import noise_flac, sine_wav, synthetic_image_png, synthetic_video
from epd import wire
from epd.client import chat_request, content_part, generate
from epd.errors import DeadlineExceeded, FailedPrecondition, FieldViolation, Internal, InvalidArgument, NotFound, ResourceExhausted, Unavailable
from epd.security import TlsConfig
from epd.server import ServerConfig
from epd.telemetry import scrape
from epd.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from gateway import openai_wire
from gateway.config import GatewayConfig
from gateway.media_fetch import MediaFetcher, MediaFetchError, address_problem, check_url
from gateway.openai_front import OpenAIFront
from gateway.pipeline import Mode
from tests.conftest import DEFAULT_FAMILY
from tests.helpers import gateway_stub, wait_for_metric

TOKEN = "openai-front-token"
PUBLIC = "93.184.215.14"  # a globally routable address; the fake resolver hands it out, nothing dials it


# --- the SSRF guard -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "problem"),
    [
        ("127.0.0.1", "loopback"),
        ("::1", "loopback"),
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("192.168.1.1", "private"),
        ("fc00::1", "private"),
        ("169.254.169.254", "link-local"),  # cloud metadata
        ("fe80::1%eth0", "link-local"),
        ("224.0.0.1", "multicast"),
        ("ff02::1", "multicast"),
        ("240.0.0.1", "reserved"),
        ("100.64.0.1", "not globally routable"),  # carrier-grade NAT
        ("192.0.0.8", "not globally routable"),
        ("::ffff:127.0.0.1", f"loopback (in {ipaddress.ip_address('::ffff:127.0.0.1')})"),  # IPv4-mapped
        ("::ffff:169.254.169.254", f"link-local (in {ipaddress.ip_address('::ffff:169.254.169.254')})"),
        ("2002:a00:1::", "private (in 2002:a00:1::)"),  # 6to4 of 10.0.0.1
        ("64:ff9b::a00:1", "reserved"),  # NAT64
        (PUBLIC, None),
        ("8.8.8.8", None),
        ("2001:4860:4860::8888", None),
        ("::ffff:8.8.8.8", None),
    ],
)
def test_address_classes(address, problem):
    assert address_problem(address) == problem


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("ftp://media.example.com/a.png", "scheme 'ftp'"),
        ("file:///etc/passwd", "scheme 'file'"),
        ("gopher://media.example.com/", "scheme 'gopher'"),
        ("http://user:pw@media.example.com/a.png", "credentials"),
        ("http://evil.example.net/a.png", "'evil.example.net', which is not in"),
        ("http://cdn.media.example.com/a.png", "'cdn.media.example.com', which is not in"),  # exact hosts only
        ("http://media.example.com.evil.net/a.png", "which is not in"),
        ("http://127.0.0.1/a.png", "'127.0.0.1', which is not in"),
    ],
)
def test_urls_outside_the_policy_are_refused(url, reason):
    with pytest.raises(MediaFetchError, match=reason):
        check_url(url, frozenset({"media.example.com"}))


def test_allowed_hosts_match_without_case_or_trailing_dot():
    allowed = MediaFetcher(["Media.Example.COM."], max_item_bytes=1, max_request_bytes=1, timeout_s=1).allowed_hosts
    assert check_url("https://MEDIA.example.com./a.png", allowed).path == "/a.png"


class FakeWeb:
    """Fake DNS and servers: ``routes`` maps a host to its addresses, ``pages`` maps a URL (by
    its host name) to a response builder; every request is recorded."""

    def __init__(self, routes: dict[str, list[str]], pages: dict[str, Callable[[], httpx.Response]]):
        self.routes = routes
        self.pages = pages
        self.requests: list[httpx.Request] = []

    async def resolve(self, host: str, port: int) -> list[str]:
        if host not in self.routes:
            raise OSError("Name or service not known")
        return self.routes[host]

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return self.pages[f"{request.url.scheme}://{request.headers['host']}{request.url.path}"]()

    def fetcher(self, allowed: list[str], max_item_bytes: int = 1024, max_request_bytes: int = 4096, max_redirects: int = 5) -> MediaFetcher:
        transport = httpx.MockTransport(self.handle)
        limits = {"max_item_bytes": max_item_bytes, "max_request_bytes": max_request_bytes}
        return MediaFetcher(allowed, **limits, timeout_s=5, max_redirects=max_redirects, resolve=self.resolve, transport=transport)


async def _fetch(fetcher: MediaFetcher, url: str):
    """One URL's media; raises its MediaFetchError."""
    (result,) = await fetcher.fetch_all([url])
    if isinstance(result, MediaFetchError):
        raise result
    return result


def _png_page() -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "image/png; charset=binary"}, content=b"png-bytes")


def _redirect(location: str) -> Callable[[], httpx.Response]:
    return lambda: httpx.Response(302, headers={"location": location})


async def test_a_fetch_dials_the_address_it_checked():
    web = FakeWeb({"media.example.com": [PUBLIC]}, {"https://media.example.com/a.png": _png_page})
    media = await _fetch(web.fetcher(["media.example.com"]), "https://media.example.com/a.png")
    assert (media.data, media.mime_type) == (b"png-bytes", "image/png")
    (request,) = web.requests
    # The connection goes to the checked IP; the name stays in Host, SNI and the certificate check.
    assert request.url.host == PUBLIC
    assert request.headers["host"] == "media.example.com"
    assert request.extensions["sni_hostname"] == "media.example.com"


async def test_every_redirect_is_checked_again():
    pages = {
        "http://media.example.com/to-evil": _redirect("http://evil.example.net/a.png"),
        "http://media.example.com/to-internal": _redirect("http://internal.example.com/a.png"),
        "http://media.example.com/to-loopback": _redirect("http://127.0.0.1:8080/admin"),
        "http://media.example.com/to-file": _redirect("file:///etc/passwd"),
        "http://media.example.com/relative": _redirect("/a.png"),
        "http://media.example.com/loop": _redirect("/loop"),
        "http://media.example.com/a.png": _png_page,
    }
    routes = {"media.example.com": [PUBLIC], "internal.example.com": ["10.0.0.5"], "evil.example.net": [PUBLIC]}
    web = FakeWeb(routes, pages)
    fetcher = web.fetcher(["media.example.com", "internal.example.com"], max_redirects=3)
    for path, reason in [
        ("to-evil", "'evil.example.net', which is not in"),
        ("to-internal", r"resolves to a blocked address \(10.0.0.5: private\)"),
        ("to-loopback", "'127.0.0.1', which is not in"),
        ("to-file", "scheme 'file'"),
        ("loop", "redirected more than 3 times"),
    ]:
        web.requests.clear()
        with pytest.raises(MediaFetchError, match=reason):
            await _fetch(fetcher, f"http://media.example.com/{path}")
        # Nothing but the allowed, public host was ever dialled.
        assert {r.url.host for r in web.requests} == {PUBLIC}, path
    assert (await _fetch(fetcher, "http://media.example.com/relative")).data == b"png-bytes"


async def test_dns_answers_with_any_blocked_address_are_refused():
    web = FakeWeb({"media.example.com": [PUBLIC, "169.254.169.254"], "gone.example.com": []}, {})
    with pytest.raises(MediaFetchError, match=r"169.254.169.254: link-local"):
        await _fetch(web.fetcher(["media.example.com"]), "http://media.example.com/a.png")
    with pytest.raises(MediaFetchError, match="does not resolve"):
        await _fetch(web.fetcher(["gone.example.com"]), "http://gone.example.com/a.png")
    assert web.requests == []


async def test_an_allowed_host_resolving_to_loopback_is_refused():
    """The real resolver, on a name that never leaves the machine (/etc/hosts)."""

    def no_request(request: httpx.Request) -> httpx.Response:
        raise AssertionError(f"dialled {request.url}")

    fetcher = MediaFetcher(["localhost"], max_item_bytes=1024, max_request_bytes=1024, timeout_s=5, transport=httpx.MockTransport(no_request))
    with pytest.raises(MediaFetchError, match=r"resolves to a blocked address \((127.0.0.1|::1): loopback\)"):
        await _fetch(fetcher, "http://localhost:9/a.png")


async def test_bodies_are_bounded_and_errors_reported():
    async def endless():
        for _ in range(100):
            yield b"x" * 100

    pages = {
        "http://media.example.com/declared": lambda: httpx.Response(200, content=b"x" * 5000),
        "http://media.example.com/chunked": lambda: httpx.Response(200, content=endless()),
        "http://media.example.com/gzip": lambda: httpx.Response(200, headers={"content-encoding": "gzip"}, content=b"x"),
        "http://media.example.com/missing": lambda: httpx.Response(404),
    }
    fetcher = FakeWeb({"media.example.com": [PUBLIC]}, pages).fetcher(["media.example.com"], max_item_bytes=1000)
    for path, reason in [
        ("declared", "is 5000 bytes, over the 1000 bytes left for it"),
        ("chunked", "is over the 1000 bytes left for it"),
        ("gzip", "Content-Encoding 'gzip'"),
        ("missing", "answered with HTTP 404"),
    ]:
        with pytest.raises(MediaFetchError, match=reason):
            await _fetch(fetcher, f"http://media.example.com/{path}")


async def test_a_requests_urls_share_its_byte_limit():
    """One at a time, each within what the items before it left of --max-request-bytes."""
    pages = {f"http://media.example.com/{n}.png": (lambda: httpx.Response(200, content=b"x" * 600)) for n in range(3)}
    fetcher = FakeWeb({"media.example.com": [PUBLIC]}, pages).fetcher(["media.example.com"], max_item_bytes=1000, max_request_bytes=1500)
    results = await fetcher.fetch_all([f"http://media.example.com/{n}.png" for n in range(3)])
    assert [len(r.data) for r in results[:2]] == [600, 600]
    assert isinstance(results[2], MediaFetchError) and "over the 300 bytes left for it" in str(results[2])


# --- JSON <-> domain ----------------------------------------------------------------------


def _data_uri(data: bytes, mime_type: str) -> str:
    return f"data:{mime_type};base64,{base64.b64encode(data).decode()}"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


async def test_a_chat_becomes_the_request_a_grpc_client_sends():
    png, wav, mp4 = synthetic_image_png(64, 48, seed=1), sine_wav(1.0), synthetic_video(64, 64, 8, fps=4, seed=1)
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": _data_uri(png, "image/png"), "detail": "auto"}},
                    {"type": "text", "text": "and"},
                    {"type": "input_audio", "input_audio": {"data": _b64(wav), "format": "wav"}},
                    {"type": "video_url", "video_url": {"url": _data_uri(mp4, "video/mp4")}},
                ],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "Sure."}]},
            {"role": "user", "content": "More."},
        ],
        "max_completion_tokens": 12,
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": 7,
        "stop": "END",
        "min_tokens": 2,
        "top_k": 5,
        "cache_salt": "tenant-7",
        "stream_options": {"include_usage": True},
        "user": "ignored",
    }
    chat = openai_wire.chat_completion_from_json(body, default_max_tokens=4096)
    via_http = await openai_wire.generate_request(chat, "r1", fetch=None)

    def message(role, *parts):
        return gateway_pb2.ChatMessage(role=role, parts=[content_part(p) for p in parts])

    sampling = common_pb2.SamplingParams(max_tokens=12, temperature=0.7, top_p=0.9, seed=7, stop=["END"], min_tokens=2, top_k=5)
    via_grpc = wire.generate_request_from_wire(
        gateway_pb2.GenerateRequest(
            request_id="r1",
            messages=[
                message(gateway_pb2.ROLE_SYSTEM, "Be brief."),
                message(gateway_pb2.ROLE_USER, (png, "image/png"), "and", (wav, "audio/wav"), (mp4, "video/mp4")),
                message(gateway_pb2.ROLE_ASSISTANT, "Sure."),
                message(gateway_pb2.ROLE_USER, "More."),
            ],
            sampling=sampling,
            cache_salt="tenant-7",
        )
    )
    assert via_http == via_grpc  # same parts, content hashes and float32 sampling values
    assert chat.stream is False and chat.return_token_ids is False
    assert openai_wire.chat_completion_from_json({**body, "max_completion_tokens": None}, default_max_tokens=4096).sampling.max_tokens == 4096


_TEXT = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"model": None}, "model"),
        ({"n": 2}, "n"),
        ({"n": True}, "n"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"logprobs": True}, "logprobs"),
        ({"stop": [1]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": -1}, "max_completion_tokens"),
        ({"min_tokens": 99, "max_tokens": 9}, "min_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"cache_salt": ""}, "cache_salt"),
        ({"cache_salt": 7}, "cache_salt"),
        ({"cache_salt": "s" * 257}, "cache_salt"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": "  "}]}, "messages"),
        ({"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content[0].image_url.url"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]},
            "messages[0].content[0].image_url",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png,%89PNG"}}]}]},
            "messages[0].content[0].image_url",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AA==", "format": "mp3"}}]}]},
            "messages[0].content[0].input_audio.format",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "file", "file": {}}]}]}, "messages[0].content[0].type"),
    ],
)
def test_requests_outside_the_api_are_refused_naming_the_field(change, param):
    body = {k: v for k, v in {"model": "m", "messages": _TEXT, **change}.items() if v is not None}
    with pytest.raises(InvalidArgument) as refused:
        openai_wire.chat_completion_from_json(body, default_max_tokens=4096)
    assert openai_wire.error_response(refused.value)[1]["error"]["param"] == param


async def test_media_problems_found_while_building_name_the_part():
    for url, problem in [
        ("data:image/png;base64,!!!", "does not hold valid base64"),
        ("data:image/png;base64,", "is empty"),
        ("https://example.com/a.png", "remote URL"),
    ]:
        body = {"model": "m", "messages": _user({"type": "image_url", "image_url": {"url": url}})}
        chat = openai_wire.chat_completion_from_json(body, default_max_tokens=8)
        with pytest.raises(InvalidArgument) as refused:
            await openai_wire.generate_request(chat, "r", fetch=None)
        assert refused.value.violations[0].field == "messages[0].content[0].image_url"
        assert problem in refused.value.violations[0].description


@pytest.mark.parametrize(
    ("field", "openai"),
    [
        ("messages[0].parts[1].image.data", "messages[0].content[1].image_url"),
        ("messages[0].parts[1].image.mime_type", "messages[0].content[1].image_url"),
        ("messages[2].parts[0].video.file.data", "messages[2].content[0].video_url"),
        ("messages[0].parts[3].audio", "messages[0].content[3].input_audio"),
        ("messages[1].parts", "messages[1].content"),
        ("messages", "messages"),
        ("sampling.top_p", "top_p"),
    ],
)
def test_pipeline_fields_get_their_openai_names(field, openai):
    assert openai_wire.openai_field(field) == openai


@pytest.mark.parametrize(
    ("error", "status", "code"),
    [
        (InvalidArgument("bad", [FieldViolation("messages[0].parts[0].image", "is not an image")]), 400, "invalid_argument"),
        (FailedPrecondition("wrong mode"), 400, "failed_precondition"),
        (NotFound("no such thing"), 404, "not_found"),
        (ResourceExhausted("encoder full", retry_after_s=3.0), 429, "resource_exhausted"),
        (Unavailable("no live encoder instance"), 503, "unavailable"),
        (DeadlineExceeded("too late"), 504, "deadline_exceeded"),
        (Internal("a bug"), 500, "internal"),
    ],
)
def test_errors_get_their_http_status(error, status, code):
    got_status, body, headers = openai_wire.error_response(error)
    assert (got_status, body["error"]["code"]) == (status, code)
    assert set(body["error"]) == {"message", "type", "param", "code"}
    if isinstance(error, InvalidArgument):
        assert body["error"]["param"] == "messages[0].content[0].image_url"
        assert body["error"]["message"] == "messages[0].content[0].image_url: is not an image"
    if status == 429:
        assert headers == {"Retry-After": "3"}


# --- the front in this process: HTTPS, and a gateway still starting ---------------------------


def _self_signed(folder) -> TlsConfig:
    """A certificate for 127.0.0.1 that is its own CA."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gateway")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .sign(key, hashes.SHA256())
    )
    (folder / "gw.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "gw.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return TlsConfig(tls_cert=str(folder / "gw.crt"), tls_key=str(folder / "gw.key"))


async def test_the_front_serves_https_with_the_gateway_certificate(tmp_path):
    """uvicorn in this very event loop, with the gateway's TLS files; no pipeline yet (the
    gateway is starting), so a chat is 503 while /v1/models answers."""
    tls = _self_signed(tmp_path)
    front = OpenAIFront(GatewayConfig(model="/models/Tiny-VL", mode=Mode.COMBINED), ServerConfig(tls=tls), None, lambda: None)
    stopping = asyncio.Event()
    port = front.start(0, stopping.wait())
    try:
        async with httpx.AsyncClient(base_url=f"https://127.0.0.1:{port}/v1", verify=ssl.create_default_context(cafile=tls.tls_cert)) as client:
            models = await client.get("/models")
            assert models.status_code == 200 and models.json()["data"][0]["id"] == "Tiny-VL"
            chat = await client.post(
                "/chat/completions", json={"model": "/models/Tiny-VL", "messages": _user({"type": "text", "text": "Hi"}), "max_tokens": 4}
            )
            assert chat.status_code == 503
            assert chat.json()["error"] == {"message": "gateway is still starting", "type": "server_error", "param": None, "code": "unavailable"}
        async with httpx.AsyncClient() as plaintext:
            with pytest.raises(httpx.HTTPError):
                await plaintext.get(f"http://127.0.0.1:{port}/v1/models")
    finally:
        stopping.set()
        await front.stop()


# --- a real stack ---------------------------------------------------------------------------


@dataclasses.dataclass
class HttpStack:
    model: str
    encoder: ServiceProcess
    combined: ServiceProcess
    gateway: ServiceProcess

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.http_port}/v1"

    def client(self, api_key: str = TOKEN) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def http_stack(stacks, tmp_path_factory, otlp_receiver):
    """An E+PD gateway with ``--http-port 0`` and a token, on the shared Qwen2.5-VL stack's
    encoder and combined decode (conftest sorts these tests among that stack's)."""
    family = stacks.get(DEFAULT_FAMILY)
    token_file = tmp_path_factory.mktemp("token") / "token"
    token_file.write_text(TOKEN + "\n")
    extra = ["--http-port", "0", "--auth-token-file", str(token_file), "--metrics-port", "0", "--otlp-endpoint", otlp_receiver.endpoint]
    args = gateway_args(family.model, "epd-combined", encoders=[family.encoder.address], decodes=[family.combined.address], extra=extra)
    with family.stack.temporary("gateway-http", args) as gateway:
        assert gateway.http_port, "EPD_LISTENING carries the HTTP port"
        yield HttpStack(family.model, family.encoder, family.combined, gateway)


@dataclasses.dataclass
class GrpcReply:
    token_ids: list[int]
    text: str
    finished: gateway_pb2.GenerateFinished


async def _grpc(stack: HttpStack, request: gateway_pb2.GenerateRequest) -> GrpcReply:
    """The same gateway's gRPC path (plaintext; the token as metadata)."""
    token_ids, text, finished = [], [], None
    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        async for response in gateway_pb2_grpc.GatewayServiceStub(channel).Generate(
            request, timeout=180, metadata=[("authorization", f"Bearer {TOKEN}")]
        ):
            if response.HasField("delta"):
                token_ids += response.delta.token_ids
                text.append(response.delta.text)
            else:
                finished = response.finished
    return GrpcReply(token_ids, "".join(text), finished)


def _image_chat(png: bytes, tokens: int) -> tuple[list[dict], gateway_pb2.GenerateRequest]:
    """One chat as OpenAI messages and as the gRPC request for it (greedy, exactly ``tokens``)."""
    messages = [
        {"role": "system", "content": "You describe pictures."},
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": _data_uri(png, "image/png")}}, {"type": "text", "text": "What is this?"}],
        },
    ]
    request = gateway_pb2.GenerateRequest(
        messages=[
            gateway_pb2.ChatMessage(role=gateway_pb2.ROLE_SYSTEM, parts=[content_part("You describe pictures.")]),
            gateway_pb2.ChatMessage(role=gateway_pb2.ROLE_USER, parts=[content_part((png, "image/png")), content_part("What is this?")]),
        ],
        sampling=common_pb2.SamplingParams(max_tokens=tokens, temperature=0, min_tokens=tokens),
    )
    return messages, request


_GREEDY = {"return_token_ids": True}


async def test_models_lists_the_served_model(http_stack):
    models = await http_stack.client().models.list()
    assert [m.id for m in models.data] == ["qwen2_5_vl-s0"]


async def test_a_completion_equals_the_grpc_reply(http_stack):
    messages, request = _image_chat(synthetic_image_png(120, 90, seed=301), 16)
    expected = await _grpc(http_stack, request)
    reply = await http_stack.client().chat.completions.create(
        model="qwen2_5_vl-s0", messages=messages, max_tokens=16, temperature=0, extra_body={**_GREEDY, "min_tokens": 16}
    )
    choice = reply.choices[0]
    assert len(expected.token_ids) == 16
    assert choice.model_extra["token_ids"] == expected.token_ids
    assert choice.message.content == expected.text
    assert choice.finish_reason == "length"
    assert reply.id.startswith("chatcmpl-") and reply.model == "qwen2_5_vl-s0"
    usage = expected.finished.usage
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (usage.prompt_tokens, 16)
    assert reply.usage.total_tokens == usage.prompt_tokens + 16
    assert usage.multimodal_tokens > 0


async def test_a_chat_is_one_trace_from_the_clients_traceparent_through_every_stage(http_stack, otlp_receiver):
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    messages, _ = _image_chat(synthetic_image_png(90, 110, seed=304), 2)
    async with httpx.AsyncClient(base_url=http_stack.base_url, timeout=180) as client:
        reply = await client.post(
            "/chat/completions",
            json={"model": "qwen2_5_vl-s0", "messages": messages, "max_tokens": 2, "temperature": 0},
            headers={"authorization": f"Bearer {TOKEN}", "traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"},
        )
    assert reply.status_code == 200, reply.text
    wanted = {"gateway", "encoder", "decode-decode"}  # the stack's decode instance serves E+PD
    deadline = time.monotonic() + 20  # exporters flush in batches every few seconds
    while not wanted <= (seen := {s.service for s in otlp_receiver.spans() if s.trace_id == trace_id}) and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    assert wanted <= seen, seen
    assert any(s.name == "POST /v1/chat/completions" and s.service == "gateway" for s in otlp_receiver.spans() if s.trace_id == trace_id)


async def test_a_stream_equals_the_grpc_reply(http_stack):
    messages, request = _image_chat(synthetic_image_png(100, 120, seed=302), 12)
    expected = await _grpc(http_stack, request)
    stream = await http_stack.client().chat.completions.create(
        model=http_stack.model,  # the checkpoint's full path names the model too
        messages=messages,
        max_completion_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={**_GREEDY, "min_tokens": 12},
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert [t for c in chunks for t in c.choices[0].model_extra.get("token_ids", [])] == expected.token_ids
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert {c.object for c in chunks} == {"chat.completion.chunk"} and len({c.id for c in chunks}) == 1
    last = chunks[-1].usage
    assert (last.prompt_tokens, last.completion_tokens, last.total_tokens) == (
        expected.finished.usage.prompt_tokens,
        12,
        expected.finished.usage.prompt_tokens + 12,
    )


async def test_a_video_data_uri_equals_the_grpc_reply(http_stack):
    mp4 = synthetic_video(64, 64, 8, fps=4, seed=303)
    request = gateway_pb2.GenerateRequest(
        messages=[gateway_pb2.ChatMessage(role=gateway_pb2.ROLE_USER, parts=[content_part((mp4, "video/mp4")), content_part("What happens?")])],
        sampling=common_pb2.SamplingParams(max_tokens=8, temperature=0, min_tokens=8),
    )
    expected = await _grpc(http_stack, request)
    content = [{"type": "video_url", "video_url": {"url": _data_uri(mp4, "video/mp4")}}, {"type": "text", "text": "What happens?"}]
    reply = await http_stack.client().chat.completions.create(
        model="qwen2_5_vl-s0", messages=[{"role": "user", "content": content}], max_tokens=8, temperature=0, extra_body={**_GREEDY, "min_tokens": 8}
    )
    assert reply.choices[0].model_extra["token_ids"] == expected.token_ids
    assert reply.usage.prompt_tokens == expected.finished.usage.prompt_tokens


async def _post(stack: HttpStack, body: dict, *, token: str | None = TOKEN) -> httpx.Response:
    headers = {"authorization": f"Bearer {token}"} if token is not None else {}
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=180) as client:
        return await client.post("/chat/completions", json=body, headers=headers)


def _user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


async def test_http_errors_are_openai_errors_naming_the_field(http_stack):
    ask = {"type": "text", "text": "What is this?"}
    cases = [
        # Refused by the stages and mapped back: the encoder cannot decode it; the model takes no audio.
        (
            {"messages": _user({"type": "image_url", "image_url": {"url": _data_uri(b"not an image at all", "image/png")}}, ask)},
            400,
            "messages[0].content[0].image_url",
        ),
        (
            {"messages": _user(ask, {"type": "input_audio", "input_audio": {"data": _b64(sine_wav(1.0)), "format": "wav"}})},
            400,
            "messages[0].content[1].input_audio",
        ),
        # Refused by the gateway's media policy, and by the front.
        (
            {"messages": _user({"type": "image_url", "image_url": {"url": _data_uri(b"II*\x00", "image/tiff")}}, ask)},
            400,
            "messages[0].content[0].image_url",
        ),
        (
            {"messages": _user({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, ask)},
            400,
            "messages[0].content[0].image_url",
        ),
        ({"messages": _user(ask), "n": 2}, 400, "n"),
        ({"messages": _user(ask), "model": "gpt-4o"}, 404, "model"),
    ]
    for change, status, param in cases:
        response = await _post(http_stack, {"model": "qwen2_5_vl-s0", "max_tokens": 4, **change})
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["param"] == param, error
        assert set(error) == {"message", "type", "param", "code"}
    remote = (
        await _post(
            http_stack, {"model": "qwen2_5_vl-s0", "messages": _user({"type": "image_url", "image_url": {"url": "http://example.com/a.png"}})}
        )
    ).json()
    assert "does not fetch: send the media inline as a data: URI" in remote["error"]["message"]
    assert (await _post(http_stack, {"model": "gpt-4o", "messages": _user(ask)})).json()["error"]["code"] == "model_not_found"


async def test_the_gateway_token_is_required(http_stack):
    body = {"model": "qwen2_5_vl-s0", "messages": _user({"type": "text", "text": "Hi"}), "max_tokens": 2}
    for token, message in [
        (None, "missing 'Authorization: Bearer <token>' header"),
        ("wrong", "invalid bearer token"),
        (TOKEN + "x", "invalid bearer token"),
    ]:
        response = await _post(http_stack, body, token=token)
        assert response.status_code == 401
        assert response.json()["error"]["message"] == message
        assert response.headers["www-authenticate"] == "Bearer"
    with pytest.raises(openai.AuthenticationError):
        await http_stack.client(api_key="wrong").models.list()


async def test_a_client_that_disconnects_mid_stream_aborts_the_request(http_stack):
    body = {
        "model": "qwen2_5_vl-s0",
        "messages": _image_chat(synthetic_image_png(128, 128, seed=304), 1)[0],
        "max_tokens": 2000,
        "min_tokens": 2000,
        "stream": True,
    }
    async with httpx.AsyncClient(base_url=http_stack.base_url, timeout=180) as client:
        async with client.stream("POST", "/chat/completions", json=body, headers={"authorization": f"Bearer {TOKEN}"}) as response:
            assert response.status_code == 200
            events = 0
            async for line in response.aiter_lines():
                events += line.startswith("data: ")
                if events == 4:
                    break
            assert scrape(http_stack.combined.metrics_port)["epd_requests_in_flight"] == 1.0
        # Leaving the block closes the connection mid-body.
    assert await wait_for_metric(http_stack.combined.metrics_port, "epd_requests_in_flight", 0.0) == 0.0
    assert await wait_for_metric(http_stack.gateway.metrics_port, "epd_requests_in_flight", 0.0) == 0.0
    assert await wait_for_metric(http_stack.encoder.metrics_port, "epd_arena_leases", 0.0) == 0.0
    assert scrape(http_stack.gateway.metrics_port).get("epd_requests_total{code=CANCELLED,method=ChatCompletions,service=gateway}") == 1.0


@pytest.mark.parametrize("family", ["qwen2_audio"])
async def test_input_audio_in_wav_and_flac_equals_the_grpc_reply(family_stack, family):
    """``input_audio`` end to end, on the audio family's stack (its own E+PD gateway with an HTTP
    port): the tokens of each clip equal what a gRPC client gets for the same chat."""
    s = family_stack
    args = gateway_args(s.model, "epd-combined", encoders=[s.encoder.address], decodes=[s.combined.address], extra=["--http-port", "0"])
    clips = {"wav": (sine_wav(1.2, freq=350.0, seed=311), "audio/wav"), "flac": (noise_flac(1.6, seed=312), "audio/flac")}
    with s.stack.temporary("gateway-http-audio", args) as gateway:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.http_port}/v1", api_key="none", max_retries=0, timeout=180)
        for audio_format, (clip, mime_type) in clips.items():
            expected = await generate(gateway_stub(gateway.address), chat_request([(clip, mime_type), "What do you hear?"], max_tokens=12, min_tokens=12), timeout=180)
            content = [{"type": "input_audio", "input_audio": {"data": _b64(clip), "format": audio_format}}, {"type": "text", "text": "What do you hear?"}]
            reply = await client.chat.completions.create(
                model=s.model, messages=[{"role": "user", "content": content}], max_tokens=12, temperature=0, extra_body={**_GREEDY, "min_tokens": 12}
            )
            assert len(expected.token_ids) == 12 and expected.finished.usage.multimodal_tokens > 0
            assert reply.choices[0].model_extra["token_ids"] == expected.token_ids, audio_format
            assert reply.usage.prompt_tokens == expected.finished.usage.prompt_tokens
