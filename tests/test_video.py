"""Video through the metadata-only path (Qwen3-VL, Qwen2.5-VL): greedy tokens equal the monolithic
vLLM run given the raw video, and bad video fails only its own request with the field named."""

from __future__ import annotations

import grpc
import pytest

from devkit.media import synthetic_frames_png, synthetic_image_png, synthetic_video
from epd.client import chat_request, generate
from epd.v1 import multimodal_pb2
from tests.conftest import MAX_VIDEO_FRAMES
from tests.helpers import MIN_TOKENS, assert_matches_monolithic, encode_then_prefill, violations, wait_for_metric

QWEN3 = pytest.mark.parametrize("family", ["qwen3_vl"])
VIDEO_FAMILIES = pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_5_vl"])


def _clip(frames: int, fps: float, seed: int, mime_type: str = "video/mp4", size=(96, 64)) -> tuple[bytes, str]:
    return synthetic_video(*size, frames, fps=fps, seed=seed, mime_type=mime_type), mime_type


def _frames(count: int, fps: float, seed: int, max_frames: int = 0) -> multimodal_pb2.Video:
    frames = [multimodal_pb2.Media(data=png, mime_type="image/png") for png in synthetic_frames_png(80, 48, count, seed=seed)]
    return multimodal_pb2.Video(frames=multimodal_pb2.VideoFrames(frames=frames, fps=fps), sampling=multimodal_pb2.VideoSampling(max_frames=max_frames))


CASES = {
    "short_clip": lambda: ["Watch:", _clip(12, 8.0, 1), "What happens?"],
    # 8 s: vLLM's Qwen loaders sample 16 frames at their default 2 fps.
    "clip_longer_than_max_frames": lambda: [_clip(80, 10.0, 2), "Summarize the clip."],
    "two_videos": lambda: [_clip(10, 5.0, 3), "then", _clip(16, 8.0, 4, "video/webm", size=(64, 96)), "Compare them."],
    "image_and_video": lambda: [(synthetic_image_png(120, 90, seed=5), "image/png"), _clip(14, 7.0, 6), "Does the picture appear in the video?"],
    "frames_with_sampling_options": lambda: [_frames(9, 6.0, 7, max_frames=4), "Describe the frames."],
}


@VIDEO_FAMILIES
@pytest.mark.parametrize("mode", ["epd", "epd-combined"])
@pytest.mark.parametrize("case", list(CASES))
async def test_video_greedy_tokens_match_monolithic(family_stack, family, mode, case):
    await assert_matches_monolithic(family_stack, CASES[case](), mode)


@pytest.mark.parametrize(("family", "field"), [("qwen3_vl", "video_timestamps_s"), ("qwen2_5_vl", "second_per_grid_ts")])
async def test_prefill_refuses_video_metadata_without_its_time_fields(family_stack, family, field):
    """Each model's own time field (vLLM's timestamps for Qwen3-VL, second_per_grid_ts for
    Qwen2.5-VL) is required to lay a video out; without it, the field is named."""
    parts = [_clip(12, 8.0, 11), "Hi"]
    assert await encode_then_prefill(family_stack, parts) is None
    error = await encode_then_prefill(family_stack, parts, lambda items: items[0].metadata.ClearField(field))
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert f"items[0].metadata.{field}" in violations(error)


@QWEN3
async def test_prefill_refuses_metadata_its_model_lays_out_differently(family_stack, family):
    """A forged grid (same row count, other shape) or row count is caught before anything runs."""

    def taller(items):
        items[0].metadata.grid_thw.h += 2

    error = await encode_then_prefill(family_stack, [_clip(12, 8.0, 13), "Hi"], taller)
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert "items[0].metadata" in violations(error)


def _parts(part) -> list:
    return [part, "Hi"]


BAD_VIDEO = {
    "truncated_mp4": (lambda: _parts((_clip(20, 10.0, 8)[0][:900], "video/mp4")), "messages[0].parts[0].video.file.data"),
    "over_the_frame_limit": (lambda: _parts(_clip(MAX_VIDEO_FRAMES + 30, 30.0, 9, size=(32, 32))), "messages[0].parts[0].video.file.data"),
    "unsupported_container": (lambda: _parts((b"FLV\x01" + b"\x00" * 64, "video/x-flv")), "messages[0].parts[0].video.file.mime_type"),
    "video_bytes_in_an_image_part": (
        lambda: _parts(multimodal_pb2.Media(data=_clip(6, 6.0, 1)[0], mime_type="video/mp4")),
        "messages[0].parts[0].image.mime_type",
    ),
    "audio_for_a_vision_model": (
        lambda: _parts(multimodal_pb2.Audio(pcm=multimodal_pb2.PcmAudio(data=b"\0\0" * 1600, sample_rate_hz=16000, channels=1, encoding=1))),
        "messages[0].parts[0].audio",
    ),
}


@QWEN3
@pytest.mark.parametrize("mode", ["epd", "epd-combined", "monolithic"])
@pytest.mark.parametrize("case", list(BAD_VIDEO))
async def test_bad_video_gets_invalid_argument_with_field(family_stack, family, mode, case):
    build, field = BAD_VIDEO[case]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await generate(family_stack.gateway_stub(mode), chat_request(build(), max_tokens=8), timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert field in violations(info.value), info.value.details()


@QWEN3
async def test_video_stack_serves_and_leaks_nothing_after_bad_input(family_stack, family):
    request = chat_request([_clip(12, 8.0, 12), "Describe."], max_tokens=16, min_tokens=MIN_TOKENS)
    oracle = await generate(family_stack.gateway_stub("monolithic"), request, timeout=180)
    for mode in ("epd", "epd-combined"):
        assert (await generate(family_stack.gateway_stub(mode), request, timeout=180)).token_ids == oracle.token_ids
    assert await wait_for_metric(family_stack.encoder.metrics_port, "epd_arena_leases", 0.0) == 0.0


@QWEN3
async def test_encoder_batches_each_modality_across_requests_and_keeps_prompt_order(family_stack, family):
    """Concurrent requests (four images, two videos, one image + video) share encoder steps
    through vLLM's scheduler, one modality per forward, and the mixed request's metadata stays
    in its prompt order."""
    import asyncio

    from epd.telemetry import scrape
    from epd.v1 import encoder_pb2, encoder_pb2_grpc

    def image(seed):
        return multimodal_pb2.MediaItem(image=multimodal_pb2.Media(data=synthetic_image_png(112, 96, seed=seed), mime_type="image/png"))

    def video(seed):
        data, mime = _clip(8, 8.0, seed)
        return multimodal_pb2.MediaItem(video=multimodal_pb2.Video(file=multimodal_pb2.Media(data=data, mime_type=mime)))

    def grew(before, after, name, modality):
        key = f"{name}{{modality={modality}}}"
        return after[key] - before.get(key, 0.0)

    encoder = family_stack.encoder
    # Whether requests meet in one engine step depends on when each reaches vLLM's queue (each is
    # decoded and rendered first, on two loaded cores), so a burst of new items is tried up to
    # three times; every burst must encode each item exactly once, in steps of one modality.
    shared_step = False
    async with grpc.aio.insecure_channel(encoder.address) as channel:
        stub = encoder_pb2_grpc.EncoderServiceStub(channel)
        for attempt in range(3):
            seed = 900 + 10 * attempt  # seeds no other test of this stack sends: no cache hits
            requests = [
                [image(seed)],
                [image(seed + 1)],
                [image(seed + 6)],
                [image(seed + 7)],
                [video(seed + 2)],
                [video(seed + 3)],
                [image(seed + 4), video(seed + 5)],
            ]
            before = scrape(encoder.metrics_port)
            responses = await asyncio.gather(*(stub.Encode(encoder_pb2.EncodeRequest(items=items), timeout=60) for items in requests))
            after = scrape(encoder.metrics_port)
            await stub.ReleaseEmbeddings(
                encoder_pb2.ReleaseEmbeddingsRequest(lease_ids=[i.embedding.nixl.lease_id for r in responses for i in r.items])
            )
            assert (grew(before, after, "epd_encoder_batch_items", "image"), grew(before, after, "epd_encoder_batch_items", "video")) == (5, 3)
            # Fewer steps than items: some step encoded items of several requests together.
            if grew(before, after, "epd_encoder_batches", "image") < 5:
                shared_step = True
                break
    assert shared_step, "no burst of five concurrent images shared an encoder step in three tries"
    mixed = responses[-1].items
    assert [i.metadata.modality for i in mixed] == [multimodal_pb2.MODALITY_IMAGE, multimodal_pb2.MODALITY_VIDEO]
    assert len(mixed[1].metadata.video_timestamps_s) == mixed[1].metadata.grid_thw.t


@QWEN3
async def test_byte_limits_per_item_and_per_request(family_stack, family):
    """A gateway with small byte limits refuses an oversized item and an oversized request, with
    the field named, before any stage works, and still serves a request within them."""
    from cli.launcher import gateway_args
    from tests.helpers import gateway_stub

    small, other = synthetic_image_png(100, 80, seed=50), synthetic_image_png(100, 80, seed=51)
    clip, mime = _clip(80, 10.0, 52)
    assert len(small) < len(clip) - 1
    limits = ["--max-item-bytes", str(len(clip) - 1), "--max-request-bytes", str(len(small) + len(other) - 1)]
    s = family_stack
    args = gateway_args(s.model, "epd", encoders=[s.encoder.address], prefills=[s.prefill.address], decodes=[s.decode.address], extra=limits)
    with s.stack.temporary("gateway-small-limits", args) as gateway:
        stub = gateway_stub(gateway.address)
        cases = {
            "messages[0].parts[0].video.file": [(clip, mime), "Hi"],
            "messages": [(small, "image/png"), (other, "image/png"), "Hi"],
        }
        for field, parts in cases.items():
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await generate(stub, chat_request(parts, max_tokens=8), timeout=60)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in violations(info.value), info.value.details()
        request = chat_request([(small, "image/png"), "Describe."], max_tokens=16, min_tokens=MIN_TOKENS)
        result = await generate(stub, request, timeout=120)
    oracle = await generate(s.gateway_stub("monolithic"), request, timeout=120)
    assert result.token_ids == oracle.token_ids
