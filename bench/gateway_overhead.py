"""Gateway overhead, measured alone: the real gateway against stand-in stages that answer at once.

The gateway (``epd gateway --mode epd``, its own process, as deployed) is pointed at an encoder,
a prefill and a decode served from this process that do no work: the encoder returns one
item's metadata and a 4 KiB inline embedding, the prefill a KV handoff, the decode streams the
tokens (one per message, as a real decode does). What remains is the gateway's own work per
request: parsing and validating the request, hashing the media, rendering the chat template,
three gRPC hops and their conversions, tracing, metrics and streaming the deltas back.

Requests go one at a time (one image, 16 output tokens), so latency is not queueing. Reported:

- ``latency_ms``: client-seen Generate latency through the gateway (p50, p99);
- ``direct_ms``: the same client streaming the same tokens straight from the stand-in decode:
  the floor of one hop; ``added_ms`` = gateway latency minus that floor (median and p99);
- ``cpu_ms_per_request``: the gateway process's CPU time (user + system) per request;
- ``relay_ms`` / ``relay_cpu_ms_per_request``: the same hops through a bare grpc.aio relay in its
  own process (Encode, Prefill, then Decode's stream relayed message by message; no parsing,
  template, routing, spans or metrics). It is the floor grpc.aio sets for the gateway's hop
  shape, so gateway minus relay is what EPD's own code adds.

Stand-in stages are legitimate here and only here: this experiment times the gateway, not a
model; the serving experiments run the real stages.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import pathlib
import time
from typing import Any

import grpc
import psutil
from grpc_health.v1 import health, health_pb2

from bench.common import RESULTS_DIR, progress, summarize, write_result

NAME = "gateway_overhead"
FAMILY = "qwen2_5_vl"
OUTPUT_TOKENS = 16
PLACEHOLDERS = 16
WIDTH = 64
DEFAULT_REQUESTS = 300
QUICK_REQUESTS = 30
WARMUP = 20
GOAL_P50_MS = 2.0


class _Encoder:
    async def Encode(self, request, context):
        from epd.v1 import encoder_pb2, multimodal_pb2

        items = []
        for item in request.items:
            metadata = multimodal_pb2.MultimodalMetadata(
                modality=multimodal_pb2.MODALITY_IMAGE,
                content_hash=item.content_hash or "0" * 64,
                placeholder_token_id=151655,
                placeholder_count=PLACEHOLDERS,
                placeholder_length=PLACEHOLDERS,
                grid_thw=multimodal_pb2.GridThw(t=1, h=8, w=8),
                embedding_shape=[PLACEHOLDERS, WIDTH],
                embedding_dtype=multimodal_pb2.TENSOR_DTYPE_FLOAT32,
            )
            embedding = multimodal_pb2.EmbeddingHandle(inline=multimodal_pb2.InlineEmbedding(data=bytes(PLACEHOLDERS * WIDTH * 4)))
            items.append(multimodal_pb2.EncodedItem(metadata=metadata, embedding=embedding))
        return encoder_pb2.EncodeResponse(items=items)

    async def ReleaseEmbeddings(self, request, context):
        from epd.v1 import encoder_pb2

        return encoder_pb2.ReleaseEmbeddingsResponse(released_count=len(request.lease_ids))

    async def GetTransferMetadata(self, request, context):
        # Inline embeddings need no NIXL agent; a consumer asking for one is a bug in the bench.
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the stand-in encoder publishes inline embeddings only")


class _Prefill:
    async def Prefill(self, request, context):
        from epd.v1 import engine_pb2, prefill_pb2

        count = len(request.prompt.token_ids)
        handoff = engine_pb2.KvHandoff(
            remote_engine_id="stand-in",
            remote_block_groups=[engine_pb2.KvBlockGroup(block_ids=list(range(1, count // 16 + 2)))],
            remote_host="127.0.0.1",
            remote_port=1,
            remote_request_id=request.request_id,
            remote_num_tokens=count,
            tp_size=1,
        )
        return prefill_pb2.PrefillResponse(first_token_id=1, kv_handoff=handoff, prompt_token_count=count)


class _Decode:
    async def Decode(self, request, context):
        from epd.v1 import common_pb2, decode_pb2

        for index in range(OUTPUT_TOKENS):
            last = index == OUTPUT_TOKENS - 1
            yield decode_pb2.DecodeResponse(
                token_ids=[100 + index],
                text="x",
                finish_reason=common_pb2.FINISH_REASON_LENGTH if last else common_pb2.FINISH_REASON_UNSPECIFIED,
                prompt_token_count=len(request.prompt.token_ids),
            )

    async def ReleaseKv(self, request, context):
        from epd.v1 import decode_pb2

        return decode_pb2.ReleaseKvResponse()


async def _serve_stand_ins() -> tuple[grpc.aio.Server, dict[str, str]]:
    from epd.v1 import decode_pb2_grpc, encoder_pb2_grpc, prefill_pb2_grpc

    server = grpc.aio.server()
    encoder_pb2_grpc.add_EncoderServiceServicer_to_server(_Encoder(), server)
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(_Prefill(), server)
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(_Decode(), server)
    health_servicer = health.aio.HealthServicer()
    from grpc_health.v1 import health_pb2_grpc

    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("epd.v1.EncoderService", "epd.v1.PrefillService", "epd.v1.DecodeService"):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    address = f"127.0.0.1:{port}"
    return server, {"encoder": address, "prefill": address, "decode": address}


def _serve_bare_relay(stage_address: str, ports: multiprocessing.Queue) -> None:
    """Runs in its own process: a GatewayService that makes the gateway's three calls and
    relays the decode's stream, with none of EPD's own work."""
    from epd.v1 import (
        decode_pb2,
        decode_pb2_grpc,
        encoder_pb2,
        encoder_pb2_grpc,
        engine_pb2,
        gateway_pb2,
        gateway_pb2_grpc,
        multimodal_pb2,
        prefill_pb2,
        prefill_pb2_grpc,
    )

    async def serve() -> None:
        async with grpc.aio.insecure_channel(stage_address) as channel:
            encoder = encoder_pb2_grpc.EncoderServiceStub(channel)
            prefill = prefill_pb2_grpc.PrefillServiceStub(channel)
            decode = decode_pb2_grpc.DecodeServiceStub(channel)
            prompt = engine_pb2.EnginePrompt(token_ids=list(range(40)))

            class Relay(gateway_pb2_grpc.GatewayServiceServicer):
                async def Generate(self, request, context):
                    # The media goes on to the encoder, as the gateway sends it.
                    image = request.messages[0].parts[0].image
                    items = [multimodal_pb2.MediaItem(image=multimodal_pb2.Media(data=image.data, mime_type=image.mime_type))]
                    await encoder.Encode(encoder_pb2.EncodeRequest(request_id=request.request_id, items=items), timeout=30)
                    await prefill.Prefill(prefill_pb2.PrefillRequest(request_id=request.request_id, prompt=prompt), timeout=30)
                    async for message in decode.Decode(decode_pb2.DecodeRequest(request_id=request.request_id, prompt=prompt), timeout=30):
                        yield gateway_pb2.GenerateResponse(delta=gateway_pb2.GenerateDelta(token_ids=message.token_ids, text=message.text))
                    yield gateway_pb2.GenerateResponse(finished=gateway_pb2.GenerateFinished())

            server = grpc.aio.server()
            gateway_pb2_grpc.add_GatewayServiceServicer_to_server(Relay(), server)
            ports.put(server.add_insecure_port("127.0.0.1:0"))
            await server.start()
            await server.wait_for_termination()

    asyncio.run(serve())


async def _measure(gateway_address: str, relay_address: str, decode_address: str, requests: int, pids: dict[str, int]) -> dict[str, Any]:
    from epd.client import chat_request, generate
    from epd.testing import synthetic_image_png
    from epd.v1 import common_pb2, decode_pb2, decode_pb2_grpc, engine_pb2, gateway_pb2_grpc

    image = synthetic_image_png(224, 224, seed=1)
    processes = {name: psutil.Process(pid) for name, pid in pids.items()}
    latencies, relayed, direct = [], [], []
    async with (
        grpc.aio.insecure_channel(gateway_address) as gateway_channel,
        grpc.aio.insecure_channel(relay_address) as relay_channel,
        grpc.aio.insecure_channel(decode_address) as decode_channel,
    ):
        gateway = gateway_pb2_grpc.GatewayServiceStub(gateway_channel)
        relay = gateway_pb2_grpc.GatewayServiceStub(relay_channel)
        decode = decode_pb2_grpc.DecodeServiceStub(decode_channel)
        direct_request = decode_pb2.DecodeRequest(
            request_id="direct",
            prompt=engine_pb2.EnginePrompt(token_ids=list(range(40))),
            sampling=common_pb2.SamplingParams(max_tokens=OUTPUT_TOKENS),
        )
        # The three paths take turns, so the machine's noise falls on all of them alike.
        for index in range(WARMUP + requests):
            request = chat_request([(image, "image/png"), "Describe it."], max_tokens=OUTPUT_TOKENS)
            if index == WARMUP:
                cpu_before = {name: process.cpu_times() for name, process in processes.items()}
            started = time.perf_counter()
            result = await generate(gateway, request, timeout=30)
            elapsed = time.perf_counter() - started
            assert len(result.token_ids) == OUTPUT_TOKENS, result
            started = time.perf_counter()
            async for _ in relay.Generate(request, timeout=30):
                pass
            relay_elapsed = time.perf_counter() - started
            started = time.perf_counter()
            async for _ in decode.Decode(direct_request, timeout=30):
                pass
            floor = time.perf_counter() - started
            if index >= WARMUP:
                latencies.append(elapsed * 1e3)
                relayed.append(relay_elapsed * 1e3)
                direct.append(floor * 1e3)
        cpu_after = {name: process.cpu_times() for name, process in processes.items()}
    cpu_ms = {
        name: ((cpu_after[name].user - cpu_before[name].user) + (cpu_after[name].system - cpu_before[name].system)) * 1e3 / requests
        for name in processes
    }
    return {
        "requests": requests,
        "latency_ms": summarize(latencies),
        "relay_ms": summarize(relayed),
        "direct_ms": summarize(direct),
        "added_ms": summarize([lat - floor for lat, floor in zip(latencies, direct, strict=True)]),
        "added_by_epd_ms": summarize([lat - bare for lat, bare in zip(latencies, relayed, strict=True)]),
        "cpu_ms_per_request": cpu_ms["gateway"],
        "relay_cpu_ms_per_request": cpu_ms["relay"],
    }


def run(*, quick: bool = False, num_requests: int | None = None, results_dir: pathlib.Path = RESULTS_DIR, command: str) -> pathlib.Path:
    from epd.checkpoints import ensure_tiny_checkpoint
    from epd.launcher import Stack, gateway_args

    model = str(ensure_tiny_checkpoint(FAMILY, pathlib.Path(__file__).resolve().parents[1] / "checkpoints"))
    requests = num_requests or (QUICK_REQUESTS if quick else DEFAULT_REQUESTS)

    async def experiment() -> dict[str, Any]:
        server, stages = await _serve_stand_ins()
        stack = Stack()
        spawn = multiprocessing.get_context("spawn")
        ports = spawn.Queue()
        relay = spawn.Process(target=_serve_bare_relay, args=(stages["encoder"], ports), daemon=True)
        try:
            relay.start()
            args = gateway_args(model, "epd", encoders=[stages["encoder"]], prefills=[stages["prefill"]], decodes=[stages["decode"]])
            gateway = stack.start("gateway-overhead", args)
            await asyncio.to_thread(stack.wait_ready, [gateway], 120)
            relay_address = f"127.0.0.1:{await asyncio.to_thread(ports.get, True, 60)}"
            return await _measure(gateway.address, relay_address, stages["decode"], requests, {"gateway": gateway.process.pid, "relay": relay.pid})
        finally:
            relay.kill()
            relay.join(10)
            await asyncio.to_thread(stack.stop)
            await server.stop(None)

    result = asyncio.run(experiment())
    result.update(model=model, output_tokens=OUTPUT_TOKENS, goal_p50_ms=GOAL_P50_MS)
    progress(
        f"{NAME}: p50 {result['latency_ms']['median']:.2f} ms (floor {result['direct_ms']['median']:.2f}, added {result['added_ms']['median']:.2f}, "
        f"bare relay {result['relay_ms']['median']:.2f}), "
        f"p99 {result['latency_ms']['p99']:.2f} ms, {result['cpu_ms_per_request']:.2f} CPU-ms per request"
    )
    return write_result(NAME, result, command=command, results_dir=results_dir)
