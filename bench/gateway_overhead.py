"""Gateway overhead, measured alone: the real gateway against stand-in stages that answer at once.

The gateway (``epd gateway --mode epd``, its own process, as deployed) is pointed at an encoder,
a prefill and a decode that do no work: the encoder returns one item's metadata and a 4 KiB
inline embedding, the prefill the first token and a KV handoff, the decode streams the tokens
after it (one per message, as a real decode does). What remains is the gateway's own work per request: parsing and validating
the request, hashing the media, three gRPC hops and their conversions, tracing, metrics and
streaming the deltas back. The gateway renders no chat template (the engine that prefills
does) and reads no model file, so it is given a model name and no checkpoint.

The stand-ins are compiled (``bench/go_stages``, grpc-go on the generated Go SDK, built here
and run as their own process), so that a call to one costs next to nothing: stand-ins on
grpc.aio spent about half a millisecond of Python per call, which this benchmark charged to the
gateway. The client that times the paths is compiled too (``go_stages -role client``): a
grpc.aio client spends Python on every message it reads, and that cost varied with what it had
run just before (its one-hop floor read 0.7 ms after one path and 1.7 ms on its own), which
moved the differences below by as much. Without the Go SDK the script generates it
(``scripts/gen_sdks.sh``).

Requests go one at a time (one image, 16 output tokens), so latency is not queueing. Reported:

- ``latency_ms``: client-seen Generate latency through the gateway (p50, p99);
- ``direct_ms``: the same client streaming the same tokens straight from the stand-in decode:
  the floor of one hop; ``added_ms`` = gateway latency minus that floor (median and p99);
- ``first_token_added_ms``: the same difference at the first token (what the gateway adds to
  TTFT: its per-request work and the encoder's and prefill's hops, the first token being the
  prefill's), and ``per_token_added_ms`` the rest spread
  over the later tokens (what relaying one more streamed token costs), so the figure for any
  output length is the first plus that many times the second;
- ``cpu_ms_per_request``: the gateway process's CPU time (user + system) per request;
- ``relay_ms`` / ``relay_added_ms`` / ``relay_cpu_ms_per_request``: the same hops through a bare
  grpc.aio relay in its own process (Encode, Prefill, then Decode's stream relayed message by
  message; no parsing, template, routing, spans or metrics). It is the floor grpc.aio sets for
  the gateway's hop shape, so gateway minus relay (``added_by_epd_ms``) is what EPD's own code
  adds;
- ``go_relay_*``: EPD's E/P/D data path alone in grpc-go (``bench/go_stages -role relay``: the
  stages' real protocol, the chat to the prefill and its token ids to the decode, with none of
  the gateway's other work): what the hop shape costs a compiled gRPC runtime on the same
  machine. The serving experiments run it against real stages too.

Stand-in stages are legitimate here and only here: this experiment times the gateway, not a
model; the serving experiments run the real stages.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import pathlib
import subprocess
import tempfile
from typing import Any

import grpc
import psutil

from bench.common import RESULTS_DIR, progress, summarize, write_result
from bench.compiled import build_go_stages, start_go, stop
from bench.formatting import fmt, machine

NAME = "gateway_overhead"
MODEL_NAME = "qwen2_5_vl"  # a name only: the gateway reads no model file
OUTPUT_TOKENS = 16  # bench/go_stages answers with as many
DEFAULT_REQUESTS = 300
QUICK_REQUESTS = 30
WARMUP = 20
# Goals: EPD's own work (the gateway minus the bare grpc.aio relay of the same hops) within this
# much p50, and no more CPU per request than that relay.
GOAL_OVER_RELAY_P50_MS = 0.5


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
                    prefilled = await prefill.Prefill(prefill_pb2.PrefillRequest(request_id=request.request_id, prompt=prompt), timeout=30)
                    yield gateway_pb2.GenerateResponse(delta=gateway_pb2.GenerateDelta(token_ids=[prefilled.first_token_id], text=prefilled.first_token_text))
                    continued = engine_pb2.EnginePrompt(token_ids=prompt.token_ids, continuation_token_ids=[prefilled.first_token_id])
                    async for message in decode.Decode(decode_pb2.DecodeRequest(request_id=request.request_id, prompt=continued), timeout=30):
                        yield gateway_pb2.GenerateResponse(delta=gateway_pb2.GenerateDelta(token_ids=message.token_ids, text=message.text))
                    yield gateway_pb2.GenerateResponse(finished=gateway_pb2.GenerateFinished())

            server = grpc.aio.server()
            gateway_pb2_grpc.add_GatewayServiceServicer_to_server(Relay(), server)
            ports.put(server.add_insecure_port("127.0.0.1:0"))
            await server.start()
            await server.wait_for_termination()

    asyncio.run(serve())


def _measure(go_stages: pathlib.Path, paths: dict[str, str], decode_address: str, requests: int, pids: dict[str, int], scratch: pathlib.Path) -> dict[str, Any]:
    """Times ``paths`` (GatewayService addresses by name: ``gateway``, ``relay``, ``go_relay``)
    and the floor with the compiled client (``go_stages -role client``), and reads the CPU time
    of the processes in ``pids`` around the timed requests."""
    from devkit.media import synthetic_image_png

    image = scratch / "image.png"
    image.write_bytes(synthetic_image_png(224, 224, seed=1))
    targets = ",".join(f"{name}={address}" for name, address in paths.items())
    processes = {name: psutil.Process(pid) for name, pid in pids.items()}
    client = subprocess.Popen(
        [str(go_stages), "-role", "client", "-targets", targets, "-decode", decode_address, "-image", str(image), "-warmup", str(WARMUP), "-requests", str(requests)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        if client.stdout.readline().strip() != "warm":
            raise RuntimeError(f"the timing client failed its warm-up (exit code {client.wait(10)})")
        cpu_before = {name: process.cpu_times() for name, process in processes.items()}
        output, _ = client.communicate("go\n", timeout=600)
        cpu_after = {name: process.cpu_times() for name, process in processes.items()}
    finally:
        stop(client)
    if client.returncode != 0:
        raise RuntimeError(f"the timing client failed (exit code {client.returncode})")
    # By path: the first message's and the last one's arrival, in ms from the request.
    timed = {name: {"first": [s * 1e3 for s in streams["first_s"]], "total": [s * 1e3 for s in streams["total_s"]]} for name, streams in json.loads(output).items()}
    cpu_ms = {
        name: ((cpu_after[name].user - cpu_before[name].user) + (cpu_after[name].system - cpu_before[name].system)) * 1e3 / requests
        for name in processes
    }
    floor = timed["floor"]

    def over_floor(stream: dict[str, list[float]], key: str) -> list[float]:
        return [sample - at_floor for sample, at_floor in zip(stream[key], floor[key], strict=True)]

    result = {"requests": requests, "direct_ms": summarize(floor["total"])}
    for name in paths:
        prefix = "" if name == "gateway" else f"{name}_"
        added, first_added = over_floor(timed[name], "total"), over_floor(timed[name], "first")
        result[f"{prefix}added_ms"] = summarize(added)
        result[f"{prefix}first_token_added_ms"] = summarize(first_added)
        result[f"{prefix}per_token_added_ms"] = summarize([(total - first) / (OUTPUT_TOKENS - 1) for total, first in zip(added, first_added, strict=True)])
        result[f"{prefix}cpu_ms_per_request"] = cpu_ms[name]
        result["latency_ms" if name == "gateway" else f"{name}_ms"] = summarize(timed[name]["total"])
    result["added_by_epd_ms"] = summarize([ours - bare for ours, bare in zip(timed["gateway"]["total"], timed["relay"]["total"], strict=True)])
    return result


def run(*, quick: bool = False, num_requests: int | None = None, results_dir: pathlib.Path = RESULTS_DIR, command: str) -> pathlib.Path:
    from cli.launcher import Stack, gateway_args

    requests = num_requests or (QUICK_REQUESTS if quick else DEFAULT_REQUESTS)

    def experiment(scratch: pathlib.Path) -> dict[str, Any]:
        go_stages = build_go_stages(scratch)
        stack = Stack()
        spawn = multiprocessing.get_context("spawn")
        ports = spawn.Queue()
        with contextlib.ExitStack() as processes:
            stages, stages_address = start_go(go_stages, "-role", "stages")
            processes.callback(stop, stages)
            go_relay, go_relay_address = start_go(go_stages, "-role", "relay", "-encoder", stages_address, "-prefill", stages_address, "-decode", stages_address)
            processes.callback(stop, go_relay)
            relay = spawn.Process(target=_serve_bare_relay, args=(stages_address, ports), daemon=True)
            relay.start()
            processes.callback(_stop_process, relay)
            args = gateway_args(MODEL_NAME, "epd", encoders=[stages_address], prefills=[stages_address], decodes=[stages_address])
            gateway = stack.start("gateway-overhead", args)
            processes.callback(stack.stop)
            stack.wait_ready([gateway], 120)
            paths = {"gateway": gateway.address, "relay": f"127.0.0.1:{ports.get(True, 60)}", "go_relay": go_relay_address}
            pids = {"gateway": gateway.process.pid, "relay": relay.pid, "go_relay": go_relay.pid}
            return _measure(go_stages, paths, stages_address, requests, pids, scratch)

    with tempfile.TemporaryDirectory(prefix="epd-gateway-overhead-") as scratch:
        result = experiment(pathlib.Path(scratch))
    result.update(model=MODEL_NAME, output_tokens=OUTPUT_TOKENS, goal_over_relay_p50_ms=GOAL_OVER_RELAY_P50_MS)
    progress(
        f"{NAME}: p50 {result['latency_ms']['median']:.2f} ms (floor {result['direct_ms']['median']:.2f}, added {result['added_ms']['median']:.2f}, "
        f"bare relay {result['relay_ms']['median']:.2f}, grpc-go relay {result['go_relay_ms']['median']:.2f}), "
        f"p99 {result['latency_ms']['p99']:.2f} ms, {result['cpu_ms_per_request']:.2f} CPU-ms per request"
    )
    return write_result(NAME, result, command=command, results_dir=results_dir)


def _stop_process(process: multiprocessing.Process) -> None:
    process.kill()
    process.join(10)


# ---- the report section ---------------------------------------------------------------------


def report(doc: dict) -> list[str]:
    latency, floor, added, ours = doc["latency_ms"], doc["direct_ms"], doc["added_ms"], doc["added_by_epd_ms"]
    relay, relay_added, go_relay, go_relay_added = doc["relay_ms"], doc["relay_added_ms"], doc["go_relay_ms"], doc["go_relay_added_ms"]
    goal = doc["goal_over_relay_p50_ms"]
    cpu, relay_cpu = doc["cpu_ms_per_request"], doc["relay_cpu_ms_per_request"]
    return [
        "## Gateway overhead, alone: the real gateway against stand-in stages that answer at once",
        "",
        f"Command: `{doc['command']}`  ",
        f"Machine: {machine(doc)}  ",
        f"{doc['requests']} sequential E/P/D requests of one 224 px PNG and {doc['output_tokens']} output tokens (one per streamed message), "
        "after a warm-up. The stand-in encoder, prefill and decode do no work and are compiled (grpc-go, `bench/go_stages`), so a call to one "
        "costs next to nothing, and so is the client that times every path (`go_stages -role client`): every millisecond is the gateway's and its "
        "three hops'. The bare relays make the same three calls from their own process, send the prefill's first token and relay the decode's stream "
        "message by message, with "
        "none of EPD's other work (no validation, hashing, routing, retries, spans or metrics): the grpc.aio one is the floor the gateway's runtime "
        "sets for this hop shape; the grpc-go one (`bench/go_stages/relay.go`, the stages' real protocol, which the serving experiments also run "
        "against real stages) what a compiled gRPC runtime costs for it, a measuring instrument. The paths take turns request by request. "
        "The gateway merges deltas its client has not read yet into one message (`gateway/run.py`), so against stand-ins that stream at once "
        "it may send fewer messages than the relays, and EPD's own work can come out below zero.",
        "",
        "| measure | median ms | p99 ms |",
        "| --- | --- | --- |",
        f"| Generate through the gateway | {fmt(latency['median'])} | {fmt(latency['p99'])} |",
        f"| the same request through the bare grpc.aio relay | {fmt(relay['median'])} | {fmt(relay['p99'])} |",
        f"| the same request through the bare grpc-go relay | {fmt(go_relay['median'])} | {fmt(go_relay['p99'])} |",
        f"| floor: the same tokens streamed straight from the stand-in decode (one hop) | {fmt(floor['median'])} | {fmt(floor['p99'])} |",
        f"| added by the gateway (per request, gateway minus floor) | {fmt(added['median'])} | {fmt(added['p99'])} |",
        f"| of which EPD's own work (per request, gateway minus grpc.aio relay) | {fmt(ours['median'])} | {fmt(ours['p99'])} |",
        f"| added by the bare grpc.aio relay (relay minus floor) | {fmt(relay_added['median'])} | {fmt(relay_added['p99'])} |",
        f"| added by the bare grpc-go relay (relay minus floor) | {fmt(go_relay_added['median'])} | {fmt(go_relay_added['p99'])} |",
        "",
        "Where the added time goes (medians, ms): at the first token (the per-request work and the hops to the encoder and the prefill, whose "
        "first token it is: what TTFT grows by), and per "
        f"later token (relaying one more streamed message; {doc['output_tokens'] - 1} here), so any output length costs the first plus that many "
        "times the second.",
        "",
        "| path | added at the first token | added per later token |",
        "| --- | --- | --- |",
        *(
            f"| {path} | {fmt(doc[prefix + 'first_token_added_ms']['median'])} | {fmt(doc[prefix + 'per_token_added_ms']['median'], 3)} |"
            for path, prefix in (("the gateway", ""), ("bare grpc.aio relay", "relay_"), ("bare grpc-go relay", "go_relay_"))
        ),
        "",
        f"CPU per request (user + system, all threads): gateway {fmt(cpu)} ms, grpc.aio relay {fmt(relay_cpu)} ms, grpc-go relay "
        f"{fmt(doc['go_relay_cpu_ms_per_request'])} ms. "
        f"Goals: EPD's own work ≤ {fmt(goal, 1)} ms p50 over the grpc.aio relay: {fmt(ours['median'])} ms, {'met' if ours['median'] <= goal else 'not met'}; "
        f"CPU per request ≤ the grpc.aio relay's: {'met' if cpu <= relay_cpu else 'not met'}.",
        "",
    ]
