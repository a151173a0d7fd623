"""Encoder throughput: vLLM's tower behind the encoder service against the HF tower the old
encoder ran, on the same images.

- ``vllm_service``: the encoder service (``epd encoder``: vLLM's encoder-only engine, an EC
  producer, fp32) on the tiny Qwen2.5-VL checkpoint. Every image is one ``Encode`` call over gRPC,
  all sent at once (saturation); each call's arena leases are given back (``ReleaseEmbeddings``)
  as soon as it returns, as a consumer's READ would end them. Items per second count from the
  first send to the last response. The service decodes the JPEG, runs vLLM's processor and tower
  (calls ready together joined into one engine request, ``services.encoder.batching``; vLLM's
  scheduler batches across requests) and publishes the rows in its arena. Each
  repeat gives the images fresh content hashes, so vLLM's encoder cache cannot serve a repeat.
- ``hf_tower``: what the encoder ran before the vLLM engine, in this process: the project's
  decoder on the same bytes, the checkpoint's HF image processor, then transformers'
  ``Qwen2_5_VLForConditionalGeneration.model.get_image_features(pixel_values, image_grid_thw)``,
  in batches of up to 16 images (the old encoder's ``max_batch_items``), fp32. Items per second
  count decode, processor and tower (no gRPC, no publishing); their split is reported too.

Both must agree on every item's embedding shape (rows x width), so they did the same work. Their
timed passes take turns (an HF pass, then a service pass), so that the ratio compares them on
the same host: the HF baseline alone moved by 10% between runs minutes apart here. The idle
service takes about 3% of a core during an HF pass (its NIXL progress threads' fallback wake-ups,
``epd.transport.wire.agent.PROGRESS_WAKEUP_US``, and its lease reaper).

Where a pass's time goes: the CPU-seconds of the service's processes (its engine core included)
and of this process (the gRPC client, on the same cores), against the pass's wall time; and the
service's own phases (``epd_encoder_phase_seconds``: decode and waiting for an engine request per
call, vLLM's processor and the engine per engine request). For the HF pipeline, its CPU-seconds.

The same service is then measured at 1, 4 and 16 Encode calls in flight with 1 to 8 images per
call (``sweep``), and with video clips; an encoder of a Qwen2-Audio checkpoint with audio clips.

Run ``python -m bench.encoder_throughput [--quick] [--repeats N] [--num-items N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import pathlib
import random
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from bench.common import RESULTS_DIR, command_line, cpu_seconds, progress, summarize, write_result
from bench.formatting import fmt, machine
from bench.workload import salt_media
from epd.domain import MediaFile, MediaInput, Modality

NAME = "encoder_throughput"
REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_CHECKPOINT_ROOT = REPO_ROOT / "checkpoints"
FAMILY = "qwen2_5_vl"
HF_BATCH_ITEMS = 16  # the old encoder's max_batch_items
HF_STAGES = ("decode", "processor", "tower")
FULL_ITEMS, QUICK_ITEMS = 64, 12
FULL_REPEATS, QUICK_REPEATS = 3, 1
IMAGE_EDGE_PX = (448, 896)  # inclusive, multiples of 28 (the tower's patch 14 x merge 2)
# The service's items/s by concurrent Encode calls and items per call (issue 32); quick: corners.
SWEEP_CONCURRENCY, SWEEP_ITEMS_PER_CALL = (1, 4, 16), (1, 2, 4, 8)
QUICK_SWEEP_CONCURRENCY, QUICK_SWEEP_ITEMS_PER_CALL = (1, 16), (1, 4)
# Video (the same Qwen2.5-VL encoder) and audio (a Qwen2-Audio encoder) rows: clips per pass, sent
# 16 calls at a time, one clip each.
CLIPS, QUICK_CLIPS = 16, 4
CLIP_CONCURRENCY = 16
VIDEO_EDGE_PX, VIDEO_FPS, VIDEO_SECONDS = 224, 10.0, 2.0
AUDIO_SECONDS = (2.0, 5.0)
AUDIO_FAMILY = "qwen2_audio"
SEED = 0
THROUGHPUT_GOAL = 0.9  # issue 32: the service at x0.9 of the in-process pipeline's items/s
_CALL_TIMEOUT_S = 300.0
_LEASES_DRAIN_S = 10.0


def build_images(count: int, seed: int = SEED) -> list[bytes]:
    """Seeded JPEGs of ``IMAGE_EDGE_PX`` on each side (the serving workload's kind of image)."""
    from devkit.media import synthetic_image

    rng = random.Random(seed)

    def edge() -> int:
        return 28 * rng.randint(IMAGE_EDGE_PX[0] // 28, IMAGE_EDGE_PX[1] // 28)

    return [synthetic_image(edge(), edge(), seed=seed * 10_007 + index, image_format="JPEG") for index in range(count)]


def run(
    *,
    quick: bool = False,
    repeats: int | None = None,
    num_items: int | None = None,
    results_dir: pathlib.Path = RESULTS_DIR,
    command: str | None = None,
    checkpoint_root: pathlib.Path | None = None,
) -> pathlib.Path:
    """Measures both encoders on the same images; writes ``encoder_throughput.json``.

    Args:
        quick: 12 images and 1 repeat.
        repeats: timed passes over the images per encoder (medians are reported).
        num_items: images per pass (default 64, quick 12).
        results_dir: where the result goes.
        command: the command line recorded in the result (default: this process's).
        checkpoint_root: parent directory of the tiny checkpoint (built there if missing).

    Returns:
        The path of the result file.

    Raises:
        RuntimeError: the two encoders disagree on an item's embedding shape, a call failed, or
            arena leases were left at the end.
    """
    from devkit.checkpoints import ensure_tiny_checkpoint

    repeats = repeats or (QUICK_REPEATS if quick else FULL_REPEATS)
    num_items = num_items or (QUICK_ITEMS if quick else FULL_ITEMS)
    clips = QUICK_CLIPS if quick else CLIPS
    sweep = (QUICK_SWEEP_CONCURRENCY, QUICK_SWEEP_ITEMS_PER_CALL) if quick else (SWEEP_CONCURRENCY, SWEEP_ITEMS_PER_CALL)
    root = checkpoint_root or DEFAULT_CHECKPOINT_ROOT
    model = ensure_tiny_checkpoint(FAMILY, root)
    images = build_images(num_items)
    items = image_items(images)
    progress(f"{NAME}: {num_items} JPEGs of {IMAGE_EDGE_PX[0]}-{IMAGE_EDGE_PX[1]} px, {repeats} repeats, {model}")
    hf_pipeline = HfPipeline(model, images)
    with encoder_service(model) as encoder:
        # The two take turns pass by pass (the service idle meanwhile), so the ratio sees one host.
        service = measure_encoder(encoder, items, repeats, alternate_with=hf_pipeline.one_pass)
        hf = hf_pipeline.result()
        progress(f"{NAME}: hf_tower {hf['items_per_s']['median']:.1f} items/s")
        progress(f"{NAME}: vllm_service {service['items_per_s']['median']:.1f} items/s, {service['mean_batch_items']:.1f} items per engine step")
        grid = measure_sweep(encoder, items, repeats, *sweep)
        video = measure_encoder(encoder, build_videos(clips), repeats, concurrency=CLIP_CONCURRENCY)
        progress(f"{NAME}: video {video['items_per_s']['median']:.1f} clips/s")
    with encoder_service(ensure_tiny_checkpoint(AUDIO_FAMILY, root)) as encoder:
        audio = measure_encoder(encoder, build_audio(clips), repeats, concurrency=CLIP_CONCURRENCY)
        progress(f"{NAME}: audio {audio['items_per_s']['median']:.1f} clips/s")
    payload = build_payload(model, repeats, hf, service, sweep=grid, video=video, audio=audio)
    progress(f"{NAME}: vLLM service / HF tower items/s ×{payload['ratios']['vllm_service_over_hf_tower']:.2f}")
    return write_result(NAME, payload, command=command or command_line(), results_dir=results_dir)


def build_videos(count: int, seed: int = SEED) -> list[MediaInput]:
    """Seeded MP4 clips of ``VIDEO_SECONDS`` at ``VIDEO_FPS``, ``VIDEO_EDGE_PX`` square."""
    from devkit.media import synthetic_video

    frames = int(VIDEO_SECONDS * VIDEO_FPS)
    return [
        MediaInput(Modality.VIDEO, MediaFile(synthetic_video(VIDEO_EDGE_PX, VIDEO_EDGE_PX, frames, fps=VIDEO_FPS, seed=seed * 10_007 + index), "video/mp4"))
        for index in range(count)
    ]


def build_audio(count: int, seed: int = SEED) -> list[MediaInput]:
    """Seeded 16 kHz WAV clips of ``AUDIO_SECONDS`` (uniform)."""
    from devkit.media import sine_samples, wav_int16

    rng = random.Random(seed)
    return [
        MediaInput(Modality.AUDIO, MediaFile(wav_int16(sine_samples(rng.uniform(*AUDIO_SECONDS), 16000, freq=rng.uniform(200, 800), seed=seed * 10_007 + index), 16000), "audio/wav"))
        for index in range(count)
    ]


def measure_sweep(encoder, items: Sequence[MediaInput], repeats: int, concurrency: Sequence[int], items_per_call: Sequence[int]) -> list[dict[str, Any]]:
    """The service's items/s for every pair of concurrent calls and items per call."""
    grid = []
    for calls in concurrency:
        for per_call in items_per_call:
            measured = measure_encoder(encoder, items, repeats, concurrency=calls, items_per_call=per_call)
            grid.append({"concurrency": calls, "items_per_call": per_call, **_public(measured)})
            progress(f"{NAME}: {calls} calls x {per_call} items: {measured['items_per_s']['median']:.1f} items/s")
    return grid


def build_payload(
    model_dir: pathlib.Path,
    repeats: int,
    hf: dict[str, Any],
    service: dict[str, Any],
    *,
    sweep: Sequence[dict[str, Any]] = (),
    video: dict[str, Any] | None = None,
    audio: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The result document.

    Raises:
        RuntimeError: the encoders disagree on an item's embedding shape (they did different
            work), or the service has arena leases left.
    """
    if hf["shapes"] != service["shapes"]:
        raise RuntimeError(f"the encoders disagree on embedding shapes: HF {hf['shapes'][:4]}... vLLM {service['shapes'][:4]}...")
    if service["arena_leases_at_end"]:
        raise RuntimeError(f"{service['arena_leases_at_end']:g} arena leases left after every lease was given back")
    return {
        "experiment": NAME,
        "config": {
            "checkpoint": model_dir.name,
            "dtype": "float32",
            "num_items": len(hf["shapes"]),
            "repeats": repeats,
            "image_edge_px": list(IMAGE_EDGE_PX),
            "image_format": "JPEG",
            "hf_batch_items": HF_BATCH_ITEMS,
            "embedding_rows": [rows for rows, _ in hf["shapes"]],
            "embedding_width": hf["shapes"][0][1],
        },
        "results": {
            "vllm_service": _public(service),
            "hf_tower": _public(hf),
            "sweep": list(sweep),
            **({"video": _public(video)} if video else {}),
            **({"audio": _public(audio)} if audio else {}),
        },
        "ratios": {"vllm_service_over_hf_tower": service["items_per_s"]["median"] / hf["items_per_s"]["median"]},
    }


def _public(measured: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in measured.items() if k != "shapes"}


# --- the old encoder: HF processor and tower, in this process --------------------------------------


class HfPipeline:
    """The old encoder, in this process: decode + HF processor + ``get_image_features`` in
    batches of ``HF_BATCH_ITEMS``. Its passes are taken one at a time (:meth:`one_pass`), so that
    they can alternate with the service's and the host's drift hits both alike."""

    def __init__(self, model_dir: pathlib.Path, images: Sequence[bytes]) -> None:
        import torch
        from transformers import AutoImageProcessor, Qwen2_5_VLForConditionalGeneration

        from epd.media import MediaLimits
        from epd.media.decode import MediaDecoder

        self._model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
        self._processor = AutoImageProcessor.from_pretrained(model_dir)
        self._decoder = MediaDecoder.for_model(model_dir, MediaLimits())
        self._items = [MediaInput(Modality.IMAGE, MediaFile(data, "image/jpeg")) for data in images]
        self._passes: list[tuple[dict[str, float], list[tuple[int, int]]]] = []
        self._run()  # warm-up: first-call allocations and lazy initialization

    def one_pass(self) -> None:
        self._passes.append(self._run())

    def result(self) -> dict[str, Any]:
        """Items/s and where the time went, over the passes taken."""
        import torch

        passes = self._passes
        totals = [sum(seconds[stage] for stage in HF_STAGES) for seconds, _ in passes]
        return {
            "items_per_s": summarize([len(self._items) / total for total in totals]),
            "seconds": summarize(totals),
            "cpu_s": summarize([seconds["cpu"] for seconds, _ in passes]),
            "cores_busy": summarize([seconds["cpu"] / total for (seconds, _), total in zip(passes, totals, strict=True)]),
            "stage_seconds_median": {stage: statistics.median(seconds[stage] for seconds, _ in passes) for stage in HF_STAGES},
            "torch_threads": torch.get_num_threads(),
            "shapes": passes[0][1],
        }

    def _run(self) -> tuple[dict[str, float], list[tuple[int, int]]]:
        import torch

        seconds = dict.fromkeys(HF_STAGES, 0.0)
        cpu_started = time.process_time()
        shapes: list[tuple[int, int]] = []
        for start in range(0, len(self._items), HF_BATCH_ITEMS):
            t0 = time.perf_counter()
            decoded = [self._decoder.decode(item).media for item in self._items[start : start + HF_BATCH_ITEMS]]  # HF takes PIL images
            t1 = time.perf_counter()
            processed = self._processor(images=decoded, return_tensors="pt")
            t2 = time.perf_counter()
            with torch.inference_mode():
                output = self._model.model.get_image_features(processed["pixel_values"], processed["image_grid_thw"])
            t3 = time.perf_counter()
            shapes += [(int(e.shape[0]), int(e.shape[1])) for e in output.pooler_output]
            for stage, elapsed in (("decode", t1 - t0), ("processor", t2 - t1), ("tower", t3 - t2)):
                seconds[stage] += elapsed
        return seconds | {"cpu": time.process_time() - cpu_started}, shapes


# --- the encoder service: vLLM's encoder-only engine ----------------------------------------------


@contextlib.contextmanager
def encoder_service(model_dir: pathlib.Path) -> Iterator[Any]:
    """An encoder service (fp32, the defaults) on ``model_dir``, its encoder-output cache off:
    every timed pass re-sends the same media, and the tower is what is measured."""
    from cli.launcher import Stack

    stack = Stack()
    progress(f"{NAME}: starting the encoder service for {model_dir.name} (log in {stack.log_dir})")
    try:
        encoder = stack.start("encoder", ["encoder", "--model", str(model_dir), "--metrics-port", "0", "--encoder-cache-bytes", "0"])
        stack.wait_ready([encoder], timeout=600)
        yield encoder
    finally:
        stack.stop()


def image_items(images: Sequence[bytes]) -> list[MediaInput]:
    return [MediaInput(Modality.IMAGE, MediaFile(data, "image/jpeg")) for data in images]


def measure_encoder(
    encoder,
    items: Sequence[MediaInput],
    repeats: int,
    *,
    concurrency: int | None = None,
    items_per_call: int = 1,
    alternate_with: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Items/s of a running encoder service (a :class:`cli.launcher.ServiceProcess`): ``items`` in
    Encode calls of ``items_per_call``, at most ``concurrency`` calls in flight (None: every call
    at once, saturation). Also where each pass's time went: the CPU of the service's processes
    and of this process (the gRPC client, on the same cores), and the service's phases
    (``epd_encoder_phase_seconds``). ``alternate_with`` runs before each pass (another
    encoder's pass, to be compared with this one)."""
    from epd.telemetry import scrape

    modality = items[0].modality.value
    counters = [f"{name}{{modality={modality}}}" for name in _COUNTERS] + list(_REQUEST_COUNTERS) + list(_PHASE_COUNTERS)
    asyncio.run(_send(encoder.address, items[:2], salt="warm-up"))
    passes = []
    for repeat in range(repeats):
        if alternate_with is not None:
            alternate_with()
        before, service_cpu_before, client_cpu_before = scrape(encoder.metrics_port), sum(cpu_seconds(encoder).values()), time.process_time()
        seconds, shapes = asyncio.run(_send(encoder.address, items, salt=f"repeat-{repeat}-{concurrency}-{items_per_call}", concurrency=concurrency, items_per_call=items_per_call))
        cpu = {"service_cpu_s": sum(cpu_seconds(encoder).values()) - service_cpu_before, "client_cpu_s": time.process_time() - client_cpu_before}
        after = scrape(encoder.metrics_port)
        delta = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in counters}
        passes.append((seconds, shapes, delta | cpu))
    total = {key: sum(delta[key] for _, _, delta in passes) for key in counters}
    steps, batch_items, call_seconds, calls = (total[f"{name}{{modality={modality}}}"] for name in _COUNTERS)
    joined_calls, requests = (total[key] for key in _REQUEST_COUNTERS)
    return {
        "items_per_s": summarize([len(items) / seconds for seconds, _, _ in passes]),
        "seconds": summarize([seconds for seconds, _, _ in passes]),
        "mean_batch_items": batch_items / steps if steps else float("nan"),
        "engine_steps": steps,
        "calls_per_engine_request": joined_calls / requests if requests else float("nan"),
        "mean_encode_call_ms": 1000 * call_seconds / calls if calls else float("nan"),
        "service_cpu_s": summarize([delta["service_cpu_s"] for _, _, delta in passes]),
        "client_cpu_s": summarize([delta["client_cpu_s"] for _, _, delta in passes]),
        "cores_busy": summarize([delta["service_cpu_s"] / seconds for seconds, _, delta in passes]),
        "phase_mean_ms": {
            phase: 1000 * total[f"epd_encoder_phase_seconds_sum{{phase={phase}}}"] / count
            for phase in PHASES
            if (count := total[f"epd_encoder_phase_seconds_count{{phase={phase}}}"])
        },
        "arena_leases_at_end": _leases_after_drain(encoder.metrics_port),
        "shapes": passes[0][1],
    }


_COUNTERS = ("epd_encoder_batches", "epd_encoder_batch_items", "epd_encoder_seconds_sum", "epd_encoder_seconds_count")
# Encode calls joined per engine request (services.encoder.batching), over every modality.
_REQUEST_COUNTERS = ("epd_encoder_request_calls_sum", "epd_encoder_request_calls_count")
# The service's phases (epd.telemetry.ENCODER_PHASE_SECONDS): decode and queue per Encode call,
# render and engine per engine request.
PHASES = ("decode", "queue", "render", "engine")
_PHASE_COUNTERS = tuple(f"epd_encoder_phase_seconds_{part}{{phase={phase}}}" for phase in PHASES for part in ("sum", "count"))


async def _send(
    address: str, items: Sequence[MediaInput], *, salt: str, concurrency: int | None = None, items_per_call: int = 1
) -> tuple[float, list[tuple[int, int]]]:
    """Sends the items in Encode calls of ``items_per_call``, at most ``concurrency`` in flight;
    returns the seconds from the first send to the last response, and each item's embedding
    shape. Leases are given back per call."""
    import grpc

    from epd.server import CLIENT_OPTIONS
    from epd.v1 import encoder_pb2, encoder_pb2_grpc
    from epd.wire import encode_request_to_wire

    calls = [items[start : start + items_per_call] for start in range(0, len(items), items_per_call)]
    slots = asyncio.Semaphore(concurrency or len(calls))
    async with grpc.aio.insecure_channel(address, options=CLIENT_OPTIONS) as channel:
        stub = encoder_pb2_grpc.EncoderServiceStub(channel)
        done: list[float] = []

        async def one(index: int, call: Sequence[MediaInput]) -> list[tuple[int, int]]:
            # Bytes of their own per pass, so that the content hash (the key of vLLM's encoder
            # cache and of EPD's, recomputed by the encoder) is new while the pixels are not.
            salted = [MediaInput(item.modality, MediaFile(salt_media(item.source.data, item.source.mime_type, f"{salt}-{index}"), item.source.mime_type)) for item in call]
            request = encode_request_to_wire(f"bench-{salt}-{index}", salted, release_key="")
            async with slots:
                response = await stub.Encode(request, timeout=_CALL_TIMEOUT_S)
                done.append(time.perf_counter())
                leases = [encoded.embedding.nixl.lease_id for encoded in response.items if encoded.embedding.HasField("nixl")]
                if leases:
                    await stub.ReleaseEmbeddings(encoder_pb2.ReleaseEmbeddingsRequest(lease_ids=leases), timeout=_CALL_TIMEOUT_S)
            return [(int(encoded.metadata.embedding_shape[0]), int(encoded.metadata.embedding_shape[1])) for encoded in response.items]

        started = time.perf_counter()
        shapes = await asyncio.gather(*(one(index, call) for index, call in enumerate(calls)))
    return max(done) - started, [shape for call in shapes for shape in call]


def _leases_after_drain(metrics_port: int) -> float:
    """Arena leases once the release notifications have been taken in (they end asynchronously)."""
    from epd.telemetry import scrape

    deadline = time.monotonic() + _LEASES_DRAIN_S
    while (leases := scrape(metrics_port).get("epd_arena_leases", 0.0)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return leases


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.encoder_throughput", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_ITEMS} images, {QUICK_REPEATS} repeat")
    parser.add_argument("--repeats", type=int, default=None, help=f"timed passes per encoder (default {FULL_REPEATS})")
    parser.add_argument("--num-items", type=int, default=None, help=f"images per pass (default {FULL_ITEMS})")
    parser.add_argument("--results-dir", type=pathlib.Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    command = " ".join(shlex.quote(a) for a in [pathlib.Path(sys.executable).name, "-m", "bench.encoder_throughput", *sys.argv[1:]])
    print(run(quick=args.quick, repeats=args.repeats, num_items=args.num_items, results_dir=args.results_dir, command=command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


# ---- the report section ---------------------------------------------------------------------


def _where_the_time_goes(service: dict, hf: dict) -> list[str]:
    """CPU against wall time per pass, and the service's phases: whether the service is short of
    CPU or leaves cores idle, and in which phase a call waits."""
    phases = service["phase_mean_ms"]
    labels = {"decode": "decode", "queue": "waiting for an engine request", "render": "vLLM's processor", "engine": "the engine (scheduler, tower, arena write)"}

    def mean(phase: str) -> str:
        return f"{labels[phase]} {fmt(phases[phase], 1)} ms" if phase in phases else f"{labels[phase]} not seen"

    return [
        f"Where a pass's time goes (medians per pass): the service spent {fmt(service['service_cpu_s']['median'], 3)} CPU-seconds, its engine included, "
        f"{fmt(service['cores_busy']['median'], 2)} cores busy on average, and this benchmark's gRPC client {fmt(service['client_cpu_s']['median'], 3)} on the same cores; "
        f"the HF pipeline spent {fmt(hf['cpu_s']['median'], 3)} ({fmt(hf['cores_busy']['median'], 2)} cores busy). "
        f"Mean per Encode call: {mean('decode')}, {mean('queue')}; per engine request: {mean('render')}, {mean('engine')} "
        "(`epd_encoder_phase_seconds`).",
        "",
    ]


def report(doc: dict) -> list[str]:
    cfg, results = doc["config"], doc["results"]
    service, hf = results["vllm_service"], results["hf_tower"]
    stages = ", ".join(f"{stage} {fmt(seconds, 3)} s" for stage, seconds in hf["stage_seconds_median"].items())
    lines = [
        "## Encoder throughput: vLLM's tower (encoder service) vs the HF tower",
        "",
        f"Command: `{doc['command']}`  ",
        f"Machine: {machine(doc)}  ",
        f"Checkpoint `{cfg['checkpoint']}`, {cfg['dtype']}; {cfg['num_items']} JPEGs of {cfg['image_edge_px'][0]}-{cfg['image_edge_px'][1]} px "
        f"({min(cfg['embedding_rows'])}-{max(cfg['embedding_rows'])} embedding rows of {cfg['embedding_width']}); medians over {cfg['repeats']} passes.",
        "",
        "| encoder | items/s median | seconds per pass median | how |",
        "| --- | --- | --- | --- |",
        f"| vllm_service | {fmt(service['items_per_s']['median'])} | {fmt(service['seconds']['median'], 3)} | one Encode call per image over gRPC, all at once, "
        f"leases released; {fmt(service['mean_batch_items'], 1)} items per engine step, {fmt(service['calls_per_engine_request'], 1)} calls per engine request, "
        f"mean Encode call {fmt(service['mean_encode_call_ms'], 1)} ms |",
        f"| hf_tower | {fmt(hf['items_per_s']['median'])} | {fmt(hf['seconds']['median'], 3)} | in-process decode + HF processor + get_image_features, "
        f"batches of {cfg['hf_batch_items']}, {hf['torch_threads']} torch threads, its passes taking turns with the service's; {stages} |",
    ]
    for modality in ("video", "audio"):
        if modality in results:
            row = results[modality]
            lines.append(
                f"| vllm_service, {modality} | {fmt(row['items_per_s']['median'])} | {fmt(row['seconds']['median'], 3)} | "
                f"{'MP4 clips (the same encoder)' if modality == 'video' else 'WAV clips (a Qwen2-Audio encoder)'}, {CLIP_CONCURRENCY} Encode calls at a time, one clip each; "
                f"{fmt(row['mean_batch_items'], 1)} items per engine step, {fmt(row['calls_per_engine_request'], 1)} calls per engine request |"
            )
    lines += [
        "",
        f"Ratio (vLLM service over HF tower, items/s): ×{fmt(doc['ratios']['vllm_service_over_hf_tower'], 3)} (goal ×0.9: "
        f"{'met' if doc['ratios']['vllm_service_over_hf_tower'] >= THROUGHPUT_GOAL else 'NOT met'}). Arena leases at the end: {service['arena_leases_at_end']:g}.",
        "",
        *_where_the_time_goes(service, hf),
    ]
    if results.get("sweep"):
        per_call = sorted({cell["items_per_call"] for cell in results["sweep"]})
        lines += [
            "The service's images/s by Encode calls in flight (rows) and images per call (columns), medians; items per engine step and calls per engine request in brackets:",
            "",
            "| calls in flight | " + " | ".join(f"{k} per call" for k in per_call) + " |",
            "| --- | " + " | ".join("---" for _ in per_call) + " |",
        ]
        for calls in sorted({cell["concurrency"] for cell in results["sweep"]}):
            cells = {cell["items_per_call"]: cell for cell in results["sweep"] if cell["concurrency"] == calls}
            lines.append(
                f"| {calls} | "
                + " | ".join(
                    f"{fmt(cells[k]['items_per_s']['median'])} ({fmt(cells[k]['mean_batch_items'], 1)}, {fmt(cells[k].get('calls_per_engine_request', float('nan')), 1)})"
                    if k in cells
                    else ""
                    for k in per_call
                )
                + " |"
            )
        lines.append("")
    return lines
