"""Encoder memory over distinct image sizes: an encoder that sees a new image size with every
request must not grow without bound.

The tiny Qwen2.5-VL encoder alone on loopback; one Encode call after another, each of one PNG
of a size no earlier call had (a new patch grid every time), its lease given back. vLLM's
tower keys tables by grid and oneDNN builds primitives per shape, so this is where a per-size
cache without a byte bound would show (the soak's 16 recurring sizes cannot). Reported every
``sample_every`` calls, per process (the service, vLLM's engine core): RSS, and its private part
(RSS less shared pages: the embedding arena is shared memory, touched slot by slot until every
slot has held an item, so it shows as growth that stops at the arena's size). Then the growth
per new size after the first sample (warm-up).
"""

from __future__ import annotations

import asyncio
import pathlib
from typing import Any

import grpc
import psutil

from bench.common import RESULTS_DIR, progress, service_processes, write_result
from bench.formatting import machine
from cli.launcher import ServiceProcess, Stack
from devkit.media import synthetic_image_png
from epd.server import CLIENT_OPTIONS
from epd.v1 import encoder_pb2, encoder_pb2_grpc, multimodal_pb2

NAME = "encoder_memory"
FAMILY = "qwen2_5_vl"
SIZES, QUICK_SIZES = 1000, 100
SAMPLE_EVERY, QUICK_SAMPLE_EVERY = 100, 25
_SIDES = 25  # 25 x 25 heights and widths, 56 to 728 px in steps of one merged patch (28 px)
_CALL_TIMEOUT_S = 60


def _size(index: int) -> tuple[int, int]:
    """The index-th distinct (width, height): 25 x 25 sides from 56 px in steps of 28, then the
    same grid moved up by 56 px a side for the next 625, and so on."""
    scale = 1 + index // (_SIDES * _SIDES)
    return 56 * scale + 28 * (index % _SIDES), 56 * scale + 28 * (index // _SIDES % _SIDES)


def _processes(service: ServiceProcess) -> dict[str, dict[str, float]]:
    """RSS and private MiB of the service, vLLM's engine core, and multiprocessing's helpers, by
    role (:func:`bench.common.service_processes`)."""
    sampled = {role: {"rss": 0.0, "private": 0.0} for role in ("service", "engine core", "helper")}
    for role, process in service_processes(service):
        try:
            memory = process.memory_info()
        except psutil.NoSuchProcess:
            continue
        sampled[role]["rss"] += memory.rss / 2**20
        sampled[role]["private"] += (memory.rss - memory.shared) / 2**20
    return sampled


def run(*, quick: bool = False, results_dir: pathlib.Path = RESULTS_DIR, command: str) -> pathlib.Path:
    from devkit.checkpoints import ensure_tiny_checkpoint

    model = str(ensure_tiny_checkpoint(FAMILY, pathlib.Path(__file__).resolve().parents[1] / "checkpoints"))
    total, sample_every = (QUICK_SIZES, QUICK_SAMPLE_EVERY) if quick else (SIZES, SAMPLE_EVERY)

    async def experiment(encoder: ServiceProcess) -> list[dict[str, Any]]:
        samples = [{"sizes": 0, **_processes(encoder)}]
        async with grpc.aio.insecure_channel(encoder.address, options=CLIENT_OPTIONS) as channel:
            stub = encoder_pb2_grpc.EncoderServiceStub(channel)
            for index in range(total):
                width, height = _size(index)
                media = multimodal_pb2.Media(data=synthetic_image_png(width, height, seed=index), mime_type="image/png")
                response = await stub.Encode(encoder_pb2.EncodeRequest(request_id=f"size-{index}", items=[multimodal_pb2.MediaItem(image=media)]), timeout=_CALL_TIMEOUT_S)
                lease = response.items[0].embedding.nixl.lease_id
                await stub.ReleaseEmbeddings(encoder_pb2.ReleaseEmbeddingsRequest(lease_ids=[lease]), timeout=_CALL_TIMEOUT_S)
                if (index + 1) % sample_every == 0:
                    samples.append({"sizes": index + 1, **_processes(encoder)})
                    progress(f"{NAME}: {index + 1} sizes, MiB " + ", ".join(f"{k} {v['rss']:.0f} ({v['private']:.0f} private)" for k, v in samples[-1].items() if k != "sizes"))
        return samples

    stack = Stack()
    try:
        encoder = stack.start("encoder", ["encoder", "--model", model, "--metrics-port", "0"])
        stack.wait_ready([encoder], timeout=900)
        samples = asyncio.run(experiment(encoder))
    finally:
        stack.stop()
    payload = {"model": model, "sizes": total, "samples": samples}
    progress(f"{NAME}: growth per new size over the second half: " + ", ".join(f"{k} {v['rss'] * 1024:.1f} KiB" for k, v in second_half_growth(samples).items()))
    return write_result(NAME, payload, command=command, results_dir=results_dir)


def second_half_growth(samples: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """MiB per new size from the sample halfway to the last, per process role: past the warm-up
    (the first sizes build the tower's per-shape state), what every further size costs."""
    middle, last = samples[len(samples) // 2], samples[-1]
    sizes = max(1, last["sizes"] - middle["sizes"])
    return {role: {kind: (last[role][kind] - middle[role][kind]) / sizes for kind in ("rss", "private")} for role in last if role != "sizes"}


# ---- the report section ---------------------------------------------------------------------


def report(doc: dict) -> list[str]:
    roles = [k for k in doc["samples"][-1] if k != "sizes"]
    lines = [
        "## Encoder memory: a new image size with every request",
        "",
        f"Command: `{doc['command']}`  ",
        f"Machine: {machine(doc)}  ",
        f"{doc['sizes']} Encode calls in a row to one encoder (`{pathlib.Path(doc['model']).name}`, caches on), each of one PNG of a size "
        "no earlier call had (56 px a side and up, in steps of 28: a new patch grid every time), its lease given back. MiB per process, RSS (private: "
        "RSS less shared pages; the embedding arena is shared memory, touched slot by slot until all have held an item).",
        "",
        "| sizes seen | " + " | ".join(f"{role} RSS | {role} private" for role in roles) + " |",
        "| --- | " + " | ".join("--- | ---" for _ in roles) + " |",
    ]
    for sample in doc["samples"]:
        lines.append(f"| {sample['sizes']} | " + " | ".join(f"{sample[r]['rss']:.0f} | {sample[r]['private']:.0f}" for r in roles) + " |")
    middle = doc["samples"][len(doc["samples"]) // 2]["sizes"]
    growth = ", ".join(f"{role} {g['rss'] * 1024:.1f} KiB RSS ({g['private'] * 1024:.1f} KiB private)" for role, g in second_half_growth(doc["samples"]).items())
    return [*lines, "", f"Growth per new size from {middle} sizes on: {growth}.", ""]
