"""Identity under load, in bf16: how often E/P/D, E+PD and monolithic vLLM, each serving 16
requests at a time, give other greedy tokens than monolithic vLLM serving each request alone.

vLLM's bf16 answers depend on what else is in the batch: a matmul over 16 rows rounds some
values differently from one over a single row, and a near-tie between two tokens can then go the
other way. So the reference is monolithic serving every request alone (at most one in flight),
and every arm is then run 16 at a time on the same requests: ``monolithic`` (vLLM itself under
load: how much of the difference is vLLM's), ``epd`` and ``epd-combined``. Each arm's streams
are also compared with monolithic's under the same load.

Workload: the Qwen2.5-Omni thinker (the tiny checkpoint, bf16), 16 requests of 1-2 JPEG images
(224-448 px) and a question, 128 greedy tokens each (``min_tokens`` = ``max_tokens``), engine
caches off, new media bytes every pass (same pixels). Repeats alternate the arms' order. (Audio
requests of the serving_omni workload showed no departure at all in 48 streams: too few
near-ties to measure anything.)

vLLM's batch-invariant mode (``VLLM_BATCH_INVARIANT=1``, ``--batch-invariant`` on every EPD
stage) would make every arm equal the reference; it does not run on vLLM's CPU platform (its
kernels are Triton's), so this measures the default mode only, on CPU.

Run ``python -m bench --only bf16_load [--repeats N]``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib
from collections.abc import Sequence

from bench.common import RESULTS_DIR, command_line, progress, write_result
from bench.formatting import fmt, machine
from bench.serving import EXPERIMENTS as SERVING_EXPERIMENTS
from bench.serving import start_stack
from bench.workload import build_requests, run_load, salted
from cli.launcher import Stack

NAME = "bf16_load"
FAMILY = "qwen2_5_omni"
DTYPE = "bfloat16"
CONCURRENCY = 16
MAX_TOKENS, QUICK_MAX_TOKENS = 128, 16
NUM_REQUESTS, QUICK_REQUESTS = 16, 4
DEFAULT_REPEATS, QUICK_REPEATS = 3, 1
ITEMS_PER_REQUEST, IMAGE_EDGE_PX = (1, 2), (224, 448)
ARMS = ("monolithic", "epd", "epd-combined")


def run(*, quick: bool = False, repeats: int | None = None, results_dir: pathlib.Path = RESULTS_DIR, command: str | None = None) -> pathlib.Path:
    """Starts a bf16 stack of every arm, measures; writes ``bf16_load.json``."""
    from devkit.checkpoints import ensure_tiny_checkpoint

    repeats = repeats or (QUICK_REPEATS if quick else DEFAULT_REPEATS)
    workload = dataclasses.replace(
        SERVING_EXPERIMENTS["serving"].workload,
        num_requests=QUICK_REQUESTS if quick else NUM_REQUESTS,
        items_per_request=ITEMS_PER_REQUEST,
        image_edge_px=IMAGE_EDGE_PX,
        max_tokens=QUICK_MAX_TOKENS if quick else MAX_TOKENS,
    )
    requests = build_requests(workload)
    model = str(ensure_tiny_checkpoint(FAMILY, pathlib.Path("checkpoints")))
    stack = Stack()
    progress(f"{NAME}: starting a {DTYPE} stack for {model} (logs in {stack.log_dir})")
    try:
        services = start_stack(stack, model, engine_flags=["--dtype", DTYPE])
        gateways = {arm: services[f"gateway-{arm}"].address for arm in ARMS}
        passes = measure(gateways, requests, repeats)
    finally:
        stack.stop()
    config = {"checkpoint": pathlib.Path(model).name, "dtype": DTYPE, "requests": len(requests), "max_tokens": workload.max_tokens, "concurrency": CONCURRENCY}
    return write_result(NAME, {"experiment": NAME, "config": config, "repeats": passes}, command=command or command_line(), results_dir=results_dir)


def measure(gateways: dict[str, str], requests: Sequence, repeats: int) -> list[dict]:
    """Per repeat: monolithic alone (the reference), then every arm ``CONCURRENCY`` at a time,
    each stream compared with the reference and with monolithic under the same load."""
    passes = []
    for repeat in range(repeats):
        progress(f"{NAME}: repeat {repeat + 1}/{repeats}: monolithic, one request at a time")
        alone = _outputs(gateways["monolithic"], salted(requests, f"{repeat} alone"), max_concurrency=1)
        loaded = {}
        for arm in ARMS[repeat % len(ARMS) :] + ARMS[: repeat % len(ARMS)]:
            progress(f"{NAME}: repeat {repeat + 1}/{repeats}: {arm}, {CONCURRENCY} at a time")
            loaded[arm] = _outputs(gateways[arm], salted(requests, f"{repeat} {arm}"), max_concurrency=CONCURRENCY)
        passes.append(
            {
                arm: {
                    "differ_from_alone": differences(alone, outputs),
                    "differ_from_monolithic_under_load": differences(loaded["monolithic"], outputs),
                }
                for arm, outputs in loaded.items()
            }
        )
    return passes


def _outputs(address: str, requests: Sequence, *, max_concurrency: int) -> list[list[int]]:
    result = asyncio.run(run_load(address, requests, float("inf"), seed=0, max_concurrency=max_concurrency))
    if result["failed"]:
        raise RuntimeError(f"{address}: {result['failed']} requests failed: {result['errors']}")
    return result["outputs"]


def differences(reference: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> list[dict]:
    """For each stream that differs from its reference: its index and the first token position
    where they part."""
    parted = []
    for index, (expected, got) in enumerate(zip(reference, outputs, strict=True)):
        if list(expected) != list(got):
            position = next((i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b), min(len(expected), len(got)))
            parted.append({"request": index, "first_differing_token": position})
    return parted


# ---- the report section ---------------------------------------------------------------------


def report(doc: dict) -> list[str]:
    cfg, passes = doc["config"], doc["repeats"]
    streams = cfg["requests"] * len(passes)
    lines = [
        "## Identity under load, bf16",
        "",
        f"Command: `{doc['command']}`  ",
        f"Machine: {machine(doc)}  ",
        f"Checkpoint `{cfg['checkpoint']}`, {cfg['dtype']}; {cfg['requests']} requests of 1-2 JPEG images and a question, {cfg['max_tokens']} greedy tokens each, "
        f"{cfg['concurrency']} at a time; {len(passes)} repeats. Reference: monolithic vLLM serving each request alone.",
        "",
        "| arm, 16 at a time | streams that differ from monolithic alone | from monolithic under the same load | first differing token (min / median) |",
        "| --- | --- | --- | --- |",
    ]
    for arm in ARMS:
        alone = [d for p in passes for d in p[arm]["differ_from_alone"]]
        loaded = [d for p in passes for d in p[arm]["differ_from_monolithic_under_load"]]
        positions = sorted(d["first_differing_token"] for d in alone)
        where = f"{positions[0]} / {positions[len(positions) // 2]}" if positions else "-"
        lines.append(f"| {arm} | {len(alone)} of {streams} ({fmt(100 * len(alone) / streams, 1)} %) | {len(loaded)} of {streams} | {where} |")
    vllm_own = sum(len(p["monolithic"]["differ_from_alone"]) for p in passes)
    ours = {arm: sum(len(p[arm]["differ_from_monolithic_under_load"]) for p in passes) for arm in ARMS if arm != "monolithic"}
    lines += [
        "",
        f"Served alone, every mode gives the same tokens (tests/test_bf16.py). Under load, monolithic vLLM departs from its own "
        f"alone run in {vllm_own} of {streams} streams: vLLM's bf16 batches round differently from one request's, and a "
        f"near-tie can go the other way. Against monolithic under the same load, E/P/D differs in {ours['epd']} and E+PD in "
        f"{ours['epd-combined']} of {streams}. vLLM's batch-invariant mode would make every arm equal the alone run; it does not "
        "run on vLLM's CPU platform (README, Models and media).",
        "",
    ]
    return lines
