"""Smoke test of the encoder-throughput benchmark (bench/encoder_throughput.py): a few images
through the real encoder service (vLLM's encoder-only engine; the shared Qwen2.5-VL stack's) and
through the HF tower, the same embedding shapes from both, every lease given back, and the
schema the report reads. (``run`` only adds starting and stopping an encoder of its own.)"""

from __future__ import annotations

import io
import json
import math
import pathlib

import pytest

from bench import encoder_throughput
from bench.common import write_result
from bench.report import write_report
from epd.domain import Modality

pytestmark = pytest.mark.timeout(600)

SUMMARY = {"count", "mean", "median", "p99"}


def positive(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def test_smoke_run_writes_the_schema(family_stack, tmp_path: pathlib.Path) -> None:
    model = pathlib.Path(family_stack.model)
    images = encoder_throughput.build_images(4)
    hf_pipeline = encoder_throughput.HfPipeline(model, images)
    encoder = family_stack.encoder
    service = encoder_throughput.measure_encoder(encoder, encoder_throughput.image_items(images), repeats=1, alternate_with=hf_pipeline.one_pass)
    hf = hf_pipeline.result()
    sweep = encoder_throughput.measure_sweep(encoder, encoder_throughput.image_items(images), 1, (1, 2), (1, 4))
    video = encoder_throughput.measure_encoder(encoder, encoder_throughput.build_videos(2), repeats=1, concurrency=2)
    payload = encoder_throughput.build_payload(model, 1, hf, service, sweep=sweep, video=video)
    path = write_result(encoder_throughput.NAME, payload, command="pytest", results_dir=tmp_path)

    doc = json.loads(path.read_text())
    assert path.name == "encoder_throughput.json" and doc["name"] == doc["experiment"] == "encoder_throughput"
    config = doc["config"]
    assert config["checkpoint"] == "qwen2_5_vl-s0" and config["num_items"] == 4 and config["dtype"] == "float32"
    assert len(config["embedding_rows"]) == 4 and all(rows > 0 for rows in config["embedding_rows"]) and config["embedding_width"] > 0

    service, hf = doc["results"]["vllm_service"], doc["results"]["hf_tower"]
    assert set(service) == {
        "items_per_s",
        "seconds",
        "mean_batch_items",
        "engine_steps",
        "calls_per_engine_request",
        "mean_encode_call_ms",
        "service_cpu_s",
        "client_cpu_s",
        "cores_busy",
        "phase_mean_ms",
        "arena_leases_at_end",
    }
    assert set(hf) == {"items_per_s", "seconds", "cpu_s", "cores_busy", "stage_seconds_median", "torch_threads"}
    # Every call was decoded, queued, rendered and encoded by the engine; the service and the HF
    # pipeline spent CPU on it.
    assert set(service["phase_mean_ms"]) == set(encoder_throughput.PHASES) and all(positive(ms) for ms in service["phase_mean_ms"].values())
    assert all(positive(result[key]["median"]) for result, key in ((service, "service_cpu_s"), (service, "cores_busy"), (hf, "cpu_s"), (hf, "cores_busy")))
    for result in (service, hf):
        assert set(result["items_per_s"]) == SUMMARY and result["items_per_s"]["count"] == 1 and positive(result["items_per_s"]["median"])
    assert service["arena_leases_at_end"] == 0
    # vLLM's scheduler encoded the 4 concurrent calls in at most 4 engine steps.
    assert 1 <= service["mean_batch_items"] <= 4 and 1 <= service["engine_steps"] <= 4
    assert set(hf["stage_seconds_median"]) == {"decode", "processor", "tower"}
    assert doc["ratios"]["vllm_service_over_hf_tower"] == pytest.approx(service["items_per_s"]["median"] / hf["items_per_s"]["median"])

    # One call in flight with one image a call is one image per engine step; a call of 4 images
    # gives vLLM's scheduler more than one at a time.
    cells = {(cell["concurrency"], cell["items_per_call"]): cell for cell in doc["results"]["sweep"]}
    assert set(cells) == {(1, 1), (1, 4), (2, 1), (2, 4)}
    assert cells[(1, 1)]["mean_batch_items"] == 1 < cells[(1, 4)]["mean_batch_items"]
    # A call alone in flight never waits to join another.
    assert cells[(1, 1)]["calls_per_engine_request"] == cells[(1, 4)]["calls_per_engine_request"] == 1
    assert 1 <= service["calls_per_engine_request"] <= 4
    assert all(positive(cell["items_per_s"]["median"]) and cell["arena_leases_at_end"] == 0 for cell in cells.values())
    video = doc["results"]["video"]
    assert positive(video["items_per_s"]["median"]) and video["arena_leases_at_end"] == 0 and video["engine_steps"] >= 1

    report = write_report(tmp_path, out=tmp_path / "BENCHMARKS.md").read_text()
    assert "## Encoder throughput" in report and "Command: `pytest`" in report and "| vllm_service |" in report
    assert "| vllm_service, video |" in report and "| 1 | " in report and "4 per call" in report
    assert "Where a pass's time goes" in report and "waiting for an engine request" in report


def test_images_are_seeded_jpegs_of_the_configured_sizes() -> None:
    from PIL import Image

    images = encoder_throughput.build_images(3)
    assert images == encoder_throughput.build_images(3) and len(set(images)) == 3
    low, high = encoder_throughput.IMAGE_EDGE_PX
    for data in images:
        image = Image.open(io.BytesIO(data))
        assert image.format == "JPEG" and all(low <= edge <= high and edge % 28 == 0 for edge in image.size)


def test_clips_are_seeded_mp4_and_wav_of_the_configured_lengths() -> None:
    import soundfile

    videos, audio = encoder_throughput.build_videos(2), encoder_throughput.build_audio(3)
    assert [v.source.data for v in videos] == [v.source.data for v in encoder_throughput.build_videos(2)] and videos[0].source.data != videos[1].source.data
    assert all(v.modality is Modality.VIDEO and v.source.mime_type == "video/mp4" and v.source.data[4:8] == b"ftyp" for v in videos)
    low, high = encoder_throughput.AUDIO_SECONDS
    for clip in audio:
        samples, rate = soundfile.read(io.BytesIO(clip.source.data))
        assert clip.modality is Modality.AUDIO and rate == 16000 and low <= len(samples) / rate <= high
