"""Encoder-output reuse: a workload where about half the items repeat, as in multi-turn chats.

Every unique image (448-896 px a side) is asked about twice, by two requests with different
questions; the repeat comes ``REPEAT_AFTER`` requests later, as the next turn of a chat would.
The checkpoint is the tiny Qwen2.5-VL at the ``costly_tower`` scale (``devkit.checkpoints``): the
tiny language model behind an 8-block, 256-wide vision tower that keeps images at up to 32 x 32
tokens (896 px a side, as the released Qwen2.5-VL), so one image costs the tower a few hundred
ms on a 2-core CPU and reuse has something to save. (The tiny checkpoint's tower, 2 blocks of
width 64 on images cut to at most 64 tokens, costs next to nothing: no cache can show there.)
``--quick``, the CI smoke run, keeps the tiny checkpoint and 4 images, to stay cheap.

One E/P/D deployment: one prefill and one decode (both with ``--no-caches``, so that vLLM's prefix
cache does not answer for the encoder), and per cache mode a pair of encoders (one pair at a
time, to fit the machine's memory) with a gateway per arm:

- ``no reuse``: the baseline, the system without a cache. Encoders with the encoder-output cache
  off, affinity routing, and every request's image sent as new bytes (the same pixels): no cache,
  vLLM's own included, can answer a repeat, so every item is encoded each time it is sent;
- ``EPD cache off``: the same encoders and the workload as it is, so vLLM's own encoder cache in
  the encoder engine answers the repeats whose output it still holds (below);
- ``local cache, least in-flight`` / ``local cache, affinity``: each encoder its own cache, with
  ``--no-affinity-routing`` / items routed by content hash;
- ``shared tier, least in-flight`` / ``shared tier, affinity``: the same plus the shared tier
  (``epd shared-cache``, Mooncake Store): an encoder finds what the other encoded.

Each arm sends its own salted copy of the workload (same pixels, new bytes: no arm's cache can
serve another's) at most ``CONCURRENCY`` in flight. Reported per arm: TTFT and E2EL
(mean/median/p99), the gateway's encode-stage time, tower runs (``epd_encoder_batch_items`` over
both encoders: the items vLLM scheduled for the tower), EPD cache hits, the items answered by
neither (vLLM's own encoder cache in the encoder engine), and whether every request's tokens
equal the monolithic run's (the result also says how many of the monolithic answers differ, so
the check is seen to depend on the image).

"EPD cache off" turns EPD's encoder-output cache off (``--encoder-cache-bytes 0``), not vLLM's own
encoder cache in the encoder engine: vLLM 0.32 sizes that one from ``max_num_batched_tokens``
(2048 embeddings here, at least one largest item; ``SchedulerConfig.encoder_cache_size`` is not
configurable) and frees entries lazily, so it answers a repeat whose output is still resident.
EPD exposes neither that size nor vLLM's ``ec_manager_config`` (a custom manager class), so the
arm runs with it as deployed, and the table counts the repeats it answered. With the costly
tower's images (256-1024 tokens) it holds 2 to 8 of them, about as many as an encoder sees
between an image and its repeat, so it answers some repeats, not all. That arm therefore is not
"without the cache"; the goal's baseline is the ``no reuse`` arm, and the table shows both.
What the arena cache adds is reuse that outlives that window and survives vLLM's eviction, and
across encoders (the shared tier). A request whose every item the arena holds skips the engine
(the cache desk); a shared-tier hit, or a request with any item not held, still pays the
encoder's per-request path (media decode, vLLM's processor, one engine step).
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import statistics
from typing import Any

import grpc

from bench.common import RESULTS_DIR, progress, summarize, write_result
from bench.formatting import fmt, machine
from bench.workload import WorkloadSpec, build_requests, run_load, salted
from cli.launcher import ServiceProcess, Stack, gateway_args, start_monolithic, start_shared_cache
from epd.client import generate
from epd.server import CLIENT_OPTIONS
from epd.telemetry import scrape
from epd.v1 import gateway_pb2, gateway_pb2_grpc

NAME = "encoder_cache"
FAMILY = "qwen2_5_vl"
SCALE = "costly_tower"  # the full run's checkpoint scale; --quick uses the tiny one
QUICK_SCALE = "tiny"
CONCURRENCY = 4
UNIQUE_ITEMS = 24
QUICK_UNIQUE_ITEMS = 4
# A repeat follows its first use this many requests later, as a chat's next turn would. On the tiny
# checkpoint (images of at most 64 tokens) vLLM's own encoder cache in the encoder engine, whose
# budget (max_num_batched_tokens, 2048) holds dozens of them, still held nearly every first use
# then (25 tower runs for 24 images with the cache off; 34 for 32 images repeated 16 later).
REPEAT_AFTER = 8
# arm -> (cache mode, affinity routing); the arms of one mode share its encoder pair.
ARMS = {
    "no reuse": ("off", True),
    "EPD cache off": ("off", True),
    "local cache, least in-flight": ("local", False),
    "local cache, affinity": ("local", True),
    "shared tier, least in-flight": ("shared", False),
    "shared tier, affinity": ("shared", True),
}
BASELINE = "no reuse"  # the arm the goal compares with: no output is ever reused


_REPEAT_SUFFIX = "-again"


def build_workload(unique: int) -> list[gateway_pb2.GenerateRequest]:
    """``2 * unique`` one-image requests; each image twice, its second use ``REPEAT_AFTER``
    requests after its first."""
    firsts = build_requests(WorkloadSpec(num_requests=unique, items_per_request=(1, 1), image_edge_px=(448, 896), max_tokens=8, seed=11))
    order: list[gateway_pb2.GenerateRequest] = []
    pending: list[tuple[int, gateway_pb2.GenerateRequest]] = []
    for index, first in enumerate(firsts):
        order.append(first)
        again = gateway_pb2.GenerateRequest()
        again.CopyFrom(first)
        again.request_id = f"{first.request_id}{_REPEAT_SUFFIX}"
        again.messages[0].parts[-1].text = f"Turn two of request {index}: and what colours does it have?"
        pending.append((index + REPEAT_AFTER, again))
        while pending and pending[0][0] <= index:
            order.append(pending.pop(0)[1])
    order += [request for _, request in pending]
    return order


def _is_repeat(request: gateway_pb2.GenerateRequest) -> bool:
    return request.request_id.endswith(_REPEAT_SUFFIX)


def _image_bytes(request: gateway_pb2.GenerateRequest) -> bytes:
    (image,) = [part.image.data for message in request.messages for part in message.parts if part.WhichOneof("content") == "image"]
    return image


def _ms(seconds: list[float]) -> dict[str, float]:
    return {k: (v * 1000 if k != "count" else v) for k, v in summarize(seconds).items()}


def _tower_runs(encoders: list[ServiceProcess]) -> tuple[float, float, float]:
    """Items scheduled for the tower, cache hits and those of them the shared tier served,
    summed over the encoders."""
    samples = [scrape(e.metrics_port) for e in encoders]
    names = ("epd_encoder_batch_items{modality=image}", "epd_encoder_cache_hits_total", "epd_encoder_cache_shared_hits_total")
    return tuple(sum(s.get(name, 0.0) for s in samples) for name in names)


def _start_engines(stack: Stack, model: str) -> tuple[ServiceProcess, ServiceProcess, ServiceProcess]:
    observability = ["--metrics-port", "0"]
    prefill = stack.start("prefill", ["prefill", "--model", model, "--no-caches", *observability])
    decode = stack.start("decode", ["decode", "--model", model, "--mode", "decode", "--no-caches", *observability])
    monolithic = start_monolithic(stack, model, extra=["--no-caches", *observability])
    stack.wait_ready([prefill, decode], timeout=900)
    return prefill, decode, monolithic


def _start_mode(stack: Stack, model: str, cache: str, prefill: ServiceProcess, decode: ServiceProcess) -> tuple[list[ServiceProcess], dict[str, ServiceProcess]]:
    """The encoder pair of one cache mode (and the shared tier it uses), and a gateway per arm."""
    observability = ["--metrics-port", "0"]
    flags = {"off": ["--encoder-cache-bytes", "0"], "local": [], "shared": start_shared_cache(stack) if cache == "shared" else []}[cache]
    encoders = [stack.start(f"encoder-{cache}-{i}", ["encoder", "--model", model, *observability, *flags]) for i in range(2)]
    stack.wait_ready(encoders, timeout=900)
    gateways = {}
    for arm, (mode, affinity) in ARMS.items():
        if mode == cache:
            extra = [*observability, *([] if affinity else ["--no-affinity-routing"])]
            args = gateway_args(model, "epd", encoders=[e.address for e in encoders], prefills=[prefill.address], decodes=[decode.address], extra=extra)
            gateways[arm] = stack.start(f"gateway-{cache}-{'affinity' if affinity else 'least'}", args)
    stack.wait_ready(list(gateways.values()), timeout=600)
    return encoders, gateways


def _stop(stack: Stack, services: list[ServiceProcess]) -> None:
    for service in services:
        service.stop()
        stack.services.remove(service)


def _vision_tower(model: str) -> dict[str, int]:
    """The checkpoint's vision-tower sizes and largest image (tokens a side), as it was built."""
    config = json.loads((pathlib.Path(model) / "config.json").read_text())["vision_config"]
    processor = json.loads((pathlib.Path(model) / "preprocessor_config.json").read_text())
    token_edge = processor["patch_size"] * processor["merge_size"]
    return {
        "depth": config["depth"],
        "hidden_size": config["hidden_size"],
        "intermediate_size": config["intermediate_size"],
        "max_image_tokens": processor["size"]["longest_edge"] // token_edge**2,
    }


def run(*, quick: bool = False, results_dir: pathlib.Path = RESULTS_DIR, command: str) -> pathlib.Path:
    from devkit.checkpoints import ensure_tiny_checkpoint

    scale = QUICK_SCALE if quick else SCALE
    model = str(ensure_tiny_checkpoint(FAMILY, pathlib.Path(__file__).resolve().parents[1] / "checkpoints", scale=scale))
    workload = build_workload(QUICK_UNIQUE_ITEMS if quick else UNIQUE_ITEMS)
    image_tokens: list[int] = []
    oracle: list[list[int]] = []  # the monolithic run's tokens, per request

    async def experiment() -> list[dict[str, Any]]:
        stack = Stack()
        try:
            prefill, decode, monolithic = await asyncio.to_thread(_start_engines, stack, model)
            async with grpc.aio.insecure_channel(monolithic.address, options=CLIENT_OPTIONS) as channel:
                stub = gateway_pb2_grpc.GatewayServiceStub(channel)
                answers = [await generate(stub, r, timeout=300) for r in workload]
            oracle.extend(list(a.token_ids) for a in answers)
            image_tokens.extend(a.finished.usage.multimodal_tokens for a in answers)
            results = []
            for cache in dict.fromkeys(mode for mode, _ in ARMS.values()):
                started = len(stack.services)
                encoders, gateways = await asyncio.to_thread(_start_mode, stack, model, cache, prefill, decode)
                # Every arm's engines warmed up alike (the first arm would otherwise pay for
                # all), on bytes no measured pass sends.
                for arm in gateways:
                    await run_load(gateways[arm].address, salted(workload[:CONCURRENCY], f"warm-{arm}"), float("inf"), seed=0, max_concurrency=CONCURRENCY)
                for arm, gateway in gateways.items():
                    index = list(ARMS).index(arm)
                    if arm == BASELINE:  # every request new bytes: its repeat is not one to any cache
                        requests = [salted([r], f"arm-{index}-{i}")[0] for i, r in enumerate(workload)]
                    else:
                        requests = salted(workload, f"arm-{index}")
                    before = _tower_runs(encoders)
                    load = await run_load(gateway.address, requests, float("inf"), seed=index, max_concurrency=CONCURRENCY)
                    after = _tower_runs(encoders)
                    same = [list(record) == expected for record, expected in zip(load.pop("outputs"), oracle, strict=True)]
                    ttft_each = load.pop("ttft_s_each")
                    tower_runs, cache_hits = after[0] - before[0], after[1] - before[1]
                    results.append(
                        {
                            "arm": arm,
                            "requests": len(requests),
                            "unique_items": len({_image_bytes(r) for r in requests}),
                            "failed": load["failed"],
                            "errors": load["errors"],
                            "tower_runs": tower_runs,
                            "cache_hits": cache_hits,
                            "shared_hits": after[2] - before[2],
                            # One image per request: the items neither the tower nor EPD's cache
                            # served were answered by vLLM's own encoder cache in the encoder engine.
                            "vllm_cache_answered": len(requests) - tower_runs - cache_hits,
                            "tokens_equal_monolithic": sum(same),
                            "ttft_ms": load["ttft_ms"],
                            # An image's first request against its repeat: what the cache can
                            # shorten, against what it cannot (the tower runs either way).
                            "ttft_first_ms": _ms([t for t, r in zip(ttft_each, requests, strict=True) if t is not None and not _is_repeat(r)]),
                            "ttft_repeat_ms": _ms([t for t, r in zip(ttft_each, requests, strict=True) if t is not None and _is_repeat(r)]),
                            "e2el_ms": load["e2el_ms"],
                            "encode_ms": load["stage_ms"]["encode"],
                        }
                    )
                    progress(f"{NAME}: {arm}: TTFT p50 {load['ttft_ms']['median']:.0f} ms, {results[-1]['tower_runs']:.0f} tower runs for {results[-1]['unique_items']} images")
                await asyncio.to_thread(_stop, stack, stack.services[started:])
            return results
        finally:
            await asyncio.to_thread(stack.stop)

    results = asyncio.run(experiment())
    payload = {
        "model": model,
        "scale": scale,
        "vision_tower": _vision_tower(model),
        "image_tokens": {"min": min(image_tokens), "median": statistics.median(image_tokens), "max": max(image_tokens)},
        # How many of the monolithic answers differ from one another: the token check can only
        # catch a wrong embedding if answers depend on the image.
        "distinct_monolithic_answers": len({tuple(tokens) for tokens in oracle}),
        "concurrency": CONCURRENCY,
        "repeat_after": REPEAT_AFTER,
        "warmed_up": True,
        "results": results,
    }
    return write_result(NAME, payload, command=command, results_dir=results_dir)


# ---- the report section ---------------------------------------------------------------------


def report(doc: dict) -> list[str]:
    tower = doc.get("vision_tower")
    tokens = doc.get("image_tokens")
    checkpoint = f"Checkpoint: `{pathlib.PurePath(doc['model']).name}`"
    if tower and tokens:
        checkpoint += (
            f", a vision tower of {tower['depth']} blocks {tower['hidden_size']} wide (MLP {tower['intermediate_size']}) "
            "in front of the tiny language model; "
            f"images keep up to {tower['max_image_tokens']} tokens, here {tokens['min']:.0f}-{tokens['max']:.0f} (median {tokens['median']:.0f})."
        )
    else:
        checkpoint += " (the tiny Qwen2.5-VL: its tower costs next to nothing)."
    if "distinct_monolithic_answers" in doc and doc["results"]:
        requests = doc["results"][0]["requests"]
        checkpoint += f" The monolithic run gave {doc['distinct_monolithic_answers']} different answers to the {requests} requests."
    lines = [
        "## Encoder-output reuse: half the items repeat",
        "",
        f"Command: `{doc['command']}`  ",
        f"Machine: {machine(doc)}  ",
        f"{checkpoint}  ",
        f"Every image is asked about twice, the second time {doc['repeat_after']} requests later with another question (one image, 8 output tokens per request), "
        f"at most {doc['concurrency']} in flight, through one E/P/D gateway per arm over two encoders, one prefill and one decode (prefill and decode with `--no-caches`). "
        "Tower runs: the items vLLM scheduled for the tower (`epd_encoder_batch_items`, both encoders); "
        "cache hits: EPD's encoder-output cache; shared hits: those the shared tier served; "
        "vLLM cache: the items neither served, which vLLM's own encoder cache in the encoder engine answered. "
        "'No reuse', the baseline: EPD's cache off and every request's image sent as new bytes (the same pixels), so that no cache can answer "
        "a repeat and every item is encoded each time it is sent. 'EPD cache off': EPD's cache off and the workload as it is, so vLLM's own "
        "cache (2048 embeddings per encoder, not configurable through EPD) answers a repeat whose output is still resident. "
        "Encode: the gateway's encode stage (decode, vLLM's processor, the tower or a cache hit, queueing). "
        "TTFT first / repeat: the TTFT p50 of the requests that bring an image for the first time, and of those that bring it again. "
        + ("Each arm's engines are warmed up first, on other bytes." if doc.get("warmed_up") else "No warm-up pass: the first arm also paid for warming the engines."),
        "",
        "| arm | requests | unique images | tower runs | cache hits | shared hits | vLLM cache | encode p50 ms "
        "| TTFT p50 / p99 ms | TTFT p50 first / repeat ms | E2EL p50 / p99 ms | tokens equal monolithic | failed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in doc["results"]:
        encode = r.get("encode_ms")
        lines.append(
            f"| {r['arm']} | {r['requests']} | {r['unique_items']} | {r['tower_runs']:.0f} | {r['cache_hits']:.0f} | {fmt(r.get('shared_hits'), 0)} "
            f"| {fmt(r.get('vllm_cache_answered'), 0)} | {fmt(encode['median'] if encode else None, 0)} "
            f"| {fmt(r['ttft_ms']['median'], 0)} / {fmt(r['ttft_ms']['p99'], 0)} "
            f"| {fmt(r.get('ttft_first_ms', {}).get('median'), 0)} / {fmt(r.get('ttft_repeat_ms', {}).get('median'), 0)} "
            f"| {fmt(r['e2el_ms']['median'], 0)} / {fmt(r['e2el_ms']['p99'], 0)} "
            f"| {r['tokens_equal_monolithic']} of {r['requests']} | {r['failed']} |"
        )
    by_arm = {r["arm"]: r for r in doc["results"]}
    baseline, vllm_cache_only = "no reuse", "EPD cache off"  # the goal's baseline; a second one, not a cache
    off = by_arm.get(baseline)
    notes = []
    met, missed = [], []
    for arm, r in by_arm.items():
        if arm == baseline or not (off and off["ttft_ms"]["median"]):
            continue
        ratio = r["ttft_ms"]["median"] / off["ttft_ms"]["median"]
        notes.append(f"TTFT p50 of '{arm}': {ratio:.3f}x the '{baseline}' arm's.")
        if arm == vllm_cache_only:
            continue
        ok = ratio <= 0.5 and r["tower_runs"] == r["unique_items"] and not r["failed"] and r["tokens_equal_monolithic"] == r["requests"]
        (met if ok else missed).append(f"'{arm}'")
    if vllm_cache_only in by_arm and (only := by_arm[vllm_cache_only]["ttft_ms"]["median"]):
        against = ", ".join(f"'{arm}' {r['ttft_ms']['median'] / only:.3f}x" for arm, r in by_arm.items() if arm not in (baseline, vllm_cache_only))
        notes.append(f"Against '{vllm_cache_only}' (vLLM's cache alone): {against}.")
    notes.append(
        f"Goals: TTFT p50 ≤ 0.5x the '{baseline}' arm's, and one tower run per unique image (with every request's tokens equal to monolithic)."
    )
    if off:
        notes.append(f"Met by: {', '.join(met) or 'none'}; not by: {', '.join(missed) or 'none'}.")
    if "shared tier, affinity" not in by_arm:
        notes.append("This result predates the shared-tier arms (`epd shared-cache`): rerun the command for them.")
    return [*lines, "", " ".join(notes), ""]
