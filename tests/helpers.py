"""Small helpers shared by the service tests."""

from __future__ import annotations

import asyncio
import pathlib
import time
import uuid

import grpc
import torch
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from epd.domain import MediaFile, MediaInput, Modality, NixlLocation
from epd.server import CLIENT_OPTIONS
from epd.telemetry import scrape
from epd.v1 import gateway_pb2_grpc
from gateway.router import read_routing_secret

# For every prefill, decode and monolithic engine the tests start: 128 Ki tokens of the tiny
# models' KV, far more than the tests hold at once (16 requests of at most 4096). Zeroing the
# default 1 GiB took 16-25 s of each stack's start on a loaded 2-core host, four engines at a
# time; this takes about one. (Encoder-only engines have no KV cache.)
SMALL_KV_CACHE = ["--kv-cache-gib", "0.125"]

_channels: dict[str, grpc.aio.Channel] = {}


def image_affinity_key(png: bytes) -> str:
    """The key the gateway routes a PNG image by (its point on the encoders' ring)."""
    return MediaInput(Modality.IMAGE, MediaFile(png, "image/png")).affinity_key


def affinity_key_flags(folder: pathlib.Path) -> tuple[list[str], bytes]:
    """Gateway flags that key its routing with a secret this test knows, and that secret, so
    the test can tell where each key lands (``HashRing(addresses, secret)``)."""
    path = folder / "affinity-key"
    path.write_text("the tests' affinity key\n")
    return ["--affinity-key-file", str(path)], read_routing_secret(str(path))


def gateway_stub(address: str) -> gateway_pb2_grpc.GatewayServiceStub:
    """A stub on the session's one channel to ``address``: closed by :func:`close_channels`."""
    if address not in _channels:
        _channels[address] = grpc.aio.insecure_channel(address, options=CLIENT_OPTIONS)
    return gateway_pb2_grpc.GatewayServiceStub(_channels[address])


async def close_channels() -> None:
    """Closes every channel :func:`gateway_stub` opened, on the loop they belong to, rather than
    leaving them to the garbage collector after that loop has closed (the suspected, unproven
    cause of a crash at interpreter exit in CI; see conftest)."""
    channels = list(_channels.values())
    _channels.clear()
    await asyncio.gather(*(channel.close() for channel in channels))


async def wait_for_metric(metrics_port: int, name: str, expected: float, timeout: float = 10.0, absent: float | None = None) -> float:
    """Polls until a metric reaches ``expected`` (leases are freed by async notifications);
    ``absent``: its value while the service has not exported it yet."""
    deadline = asyncio.get_running_loop().time() + timeout
    value = scrape(metrics_port).get(name, absent)
    while value != expected and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.1)
        value = scrape(metrics_port).get(name, absent)
    return value


def field_violations(error: grpc.aio.AioRpcError) -> list[error_details_pb2.BadRequest.FieldViolation]:
    """A status's google.rpc.BadRequest field violations."""
    found = []
    status = rpc_status.from_call(error)
    for detail in status.details if status else []:
        bad_request = error_details_pb2.BadRequest()
        if detail.Unpack(bad_request):
            found += bad_request.field_violations
    return found


def violations(error: grpc.aio.AioRpcError) -> list[str]:
    """The field paths of a status's google.rpc.BadRequest details."""
    return [v.field for v in field_violations(error)]


async def encode_then_prefill(family_stack, parts: list, mutate=None) -> grpc.aio.AioRpcError | None:
    """:func:`prefill_directly`'s error, or None if the prefill succeeded."""
    try:
        await prefill_directly(family_stack, parts, mutate)
    except grpc.aio.AioRpcError as exc:
        return exc
    return None


async def prefill_directly(family_stack, parts: list, mutate=None):
    """Encodes a chat's media on the stack's encoder, lets ``mutate`` edit the encoded items
    (protobuf ``EncodedItem`` list), then sends them to prefill directly with the chat as the
    gateway sends it (the prefill renders it), and returns that ``PrefillRequest`` and its
    ``PrefillResponse``; no decode reads the KV unless the caller has one do so. Like the
    gateway, it gives back the leases of a refused request (and raises its error)."""
    from epd import wire
    from epd.client import chat_request
    from epd.v1 import common_pb2, encoder_pb2, encoder_pb2_grpc, prefill_pb2, prefill_pb2_grpc

    chat = wire.generate_request_from_wire(chat_request(parts, max_tokens=4))
    async with grpc.aio.insecure_channel(family_stack.encoder.address) as enc, grpc.aio.insecure_channel(family_stack.prefill.address) as pre:
        encode = wire.encode_request_to_wire("direct", chat.media, "")
        items = list((await encoder_pb2_grpc.EncoderServiceStub(enc).Encode(encode, timeout=60)).items)
        if mutate is not None:
            mutate(items)
        request = prefill_pb2.PrefillRequest(
            request_id=f"direct-{chat.request_id}",
            prompt=wire.engine_prompt_to_wire(chat=chat.engine_chat()),
            items=items,
            sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0),
        )
        try:
            return request, await prefill_pb2_grpc.PrefillServiceStub(pre).Prefill(request, timeout=60)
        except grpc.aio.AioRpcError:
            leases = [item.embedding.nixl.lease_id for item in items if item.embedding.HasField("nixl")]
            await encoder_pb2_grpc.EncoderServiceStub(enc).ReleaseEmbeddings(encoder_pb2.ReleaseEmbeddingsRequest(lease_ids=leases), timeout=10)
            raise


MIN_TOKENS = 16


async def assert_matches_monolithic(family_stack, parts: list, mode: str, *, max_tokens: int = 20):
    """The bar: ``mode``'s greedy tokens (at least MIN_TOKENS) and token counts equal those of
    the monolithic vLLM run of the same request. Returns the disaggregated result."""
    from epd.client import chat_request, generate

    request = chat_request(parts, max_tokens=max_tokens, min_tokens=MIN_TOKENS)
    oracle = await generate(family_stack.gateway_stub("monolithic"), request, timeout=180)
    result = await generate(family_stack.gateway_stub(mode), request, timeout=180)
    assert len(oracle.token_ids) >= MIN_TOKENS
    assert result.token_ids == oracle.token_ids
    assert result.text == oracle.text, (result.text, oracle.text)
    assert result.finished.finish_reason == oracle.finished.finish_reason
    assert result.finished.usage.prompt_tokens == oracle.finished.usage.prompt_tokens
    assert result.finished.usage.multimodal_tokens == oracle.finished.usage.multimodal_tokens > 0
    return result



def read_published_rows(location: NixlLocation, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """An encoder's published rows, READ from its arena as a consumer engine would."""
    from epd.transport.memory.arena import SharedCounters
    from epd.transport.memory.shared_buffer import SharedBuffer
    from epd.transport.memory.slot_header import HEADER_BYTES
    from epd.transport.wire.nixl import NixlReader, Read

    buffer = SharedBuffer.create(f"test-rows-{uuid.uuid4().hex[:8]}", SharedCounters.BYTES + location.nbytes + 4096)
    reader = NixlReader(buffer.tensor, agent_name=f"test-rows-{uuid.uuid4().hex[:6]}")
    try:
        reader.submit([Read("item", location, SharedCounters.BYTES)])
        deadline = time.monotonic() + 20
        finished = []
        while not finished and time.monotonic() < deadline:
            finished = reader.poll()
        assert finished == [("item", None)], finished
        start = SharedCounters.BYTES + HEADER_BYTES
        return buffer.tensor[start : start + rows * width * dtype.itemsize].view(dtype).view(rows, width).clone()
    finally:
        reader.close()
        buffer.close()
