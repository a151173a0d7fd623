"""Placeholders rebuilt from metadata equal the HF processor's own expansion (images for both
vision families, videos with their timestamps for Qwen3-VL), and the encoder reads only the
vision tower's shards. Audio has the same checks in test_audio_family."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from epd.checkpoints import FAMILIES
from epd.domain import ChatMessage, ItemMetadata, MediaFile, MediaInput, Modality, Role, TextPart, VideoSampling
from epd.errors import InvalidArgument
from epd.media import MediaLimits
from epd.media.decode import MediaDecoder
from epd.media.image import decode_image as _decode_image
from epd.models.qwen_vl import VisionEncoder
from epd.testing import synthetic_image_png, synthetic_video
from gateway.prompt import PromptRenderer
from tests.conftest import checkpoint

SIZES = [(160, 120, 1), (224, 112, 2), (56, 300, 3)]


def decode_image(data: bytes):
    return _decode_image(data, max_pixels=MediaLimits().max_image_pixels)


def _messages(modalities: list[Modality]) -> tuple[ChatMessage, ...]:
    parts: list = [TextPart("First:")]
    for i, modality in enumerate(modalities):
        parts += [MediaInput(modality, MediaFile(b"-", "x/unused"), f"h{i}"), TextPart(f"and {i}")]
    return (ChatMessage(Role.USER, tuple(parts)),)


@pytest.mark.parametrize("family", FAMILIES)
def test_placeholders_rebuilt_from_metadata_equal_processor_expansion(family):
    from transformers import AutoProcessor

    model = checkpoint(family)
    encoder = VisionEncoder(model)
    renderer = PromptRenderer(str(model))
    images = [decode_image(synthetic_image_png(w, h, seed=s)) for w, h, s in SIZES]
    messages = _messages([Modality.IMAGE] * len(images))

    encoded = encoder.encode_images(images)
    metadata = [
        ItemMetadata(Modality.IMAGE, f"h{i}", encoder.family.image_token_id, encoder.family.placeholder_count(grid), tuple(emb.shape), "float32", grid)
        for i, (grid, emb) in enumerate(encoded)
    ]
    rebuilt = encoder.family.expand_prompt(renderer.render(messages), metadata)

    processor = AutoProcessor.from_pretrained(model)
    text = renderer.tokenizer.decode(renderer.render(messages))
    expected = processor(text=[text], images=images, return_tensors="pt")["input_ids"][0].tolist()

    assert rebuilt.token_ids == expected
    image_positions = [i for i, t in enumerate(expected) if t == encoder.family.image_token_id]
    from_ranges = [r.offset + k for r in rebuilt.ranges for k in range(r.length)]
    assert from_ranges == image_positions
    assert [r.length for r in rebuilt.ranges] == [e.shape[0] for _, e in encoded]


# (frames, fps, requested sampling): short (3 sampled, odd: padded); longer than max_frames;
# 7 frames at 2 fps (all kept); sampled at a requested 4 fps.
CLIPS = [(12, 8.0, VideoSampling()), (80, 10.0, VideoSampling()), (7, 2.0, VideoSampling()), (30, 10.0, VideoSampling(fps=4.0, max_frames=6))]


def _video_layout():
    model = checkpoint("qwen3_vl")
    encoder = VisionEncoder(model)
    decoder = MediaDecoder.for_model(model, MediaLimits())
    items = [MediaInput.of(Modality.VIDEO, MediaFile(synthetic_video(64 + 16 * i, 48, n, fps=fps, seed=i), "video/mp4"), sampling) for i, (n, fps, sampling) in enumerate(CLIPS)]
    videos = [decoder.decode(item) for item in items]
    encodings = encoder.encode(Modality.VIDEO, videos)
    metadata = [encoder.family.item_metadata(Modality.VIDEO, item.content_hash, e) for item, e in zip(items, encodings, strict=True)]
    renderer = PromptRenderer(str(model))
    return model, encoder, renderer, videos, encodings, metadata


def test_video_layout_rebuilt_from_metadata_equals_processor_expansion():
    from transformers import AutoProcessor
    from transformers.video_utils import VideoMetadata

    model, encoder, renderer, videos, encodings, metadata = _video_layout()
    family = encoder.family
    prompt = renderer.render(_messages([Modality.VIDEO] * len(videos)))
    rebuilt = family.expand_prompt(prompt, metadata)

    processor = AutoProcessor.from_pretrained(model)
    expected = processor(
        text=[renderer.tokenizer.decode(prompt)],
        videos=[v.frames for v in videos],
        video_metadata=[VideoMetadata(v.total_frames, fps=v.source_fps, frames_indices=list(v.frame_indices)) for v in videos],
        do_sample_frames=False,
        return_tensors="pt",
    )["input_ids"][0].tolist()

    assert rebuilt.token_ids == expected
    # Sampling mattered: the long clip was cut to the model's max_frames, the fps request obeyed.
    assert [len(v.frame_indices) for v in videos] == [3, 8, 7, 6]
    assert [e.grid_thw.t for e in encodings] == [2, 4, 4, 3]
    assert [len(m.video_timestamps_s) for m in metadata] == [2, 4, 4, 3]
    pads = [i for i, t in enumerate(expected) if t == family.video_token_id]
    assert sum(m.placeholder_count for m in metadata) == len(pads) == sum(e.embedding.shape[0] for e in encodings)
    for r in rebuilt.ranges:  # each run starts with its first timestamp's text and ends a group
        assert expected[r.offset + r.length - 1] == family.vision_end_token_id


def test_timestamps_shape_the_rebuilt_prompt():
    """Perturbed timestamps change the prompt (they are used, not decoration); missing ones are
    refused with the field named."""
    import dataclasses

    model, encoder, renderer, videos, encodings, metadata = _video_layout()
    family = encoder.family
    prompt = renderer.render(_messages([Modality.VIDEO]))
    intact = family.expand_prompt(prompt, metadata[1:2]).token_ids
    shifted = dataclasses.replace(metadata[1], video_timestamps_s=tuple(t + 10 for t in metadata[1].video_timestamps_s))
    assert family.expand_prompt(prompt, [shifted]).token_ids != intact
    with pytest.raises(InvalidArgument) as info:
        family.expand_prompt(prompt, [dataclasses.replace(metadata[1], video_timestamps_s=())])
    assert [v.field for v in info.value.violations] == ["items[0].metadata.video_timestamps_s"]


def test_encoder_reads_only_the_vision_shards(tmp_path):
    """Language-model shards are overwritten with garbage: an encoder that opened them would fail."""
    intact = checkpoint("qwen2_5_vl")
    broken = tmp_path / "broken"
    shutil.copytree(intact, broken)
    weight_map = json.loads((broken / "model.safetensors.index.json").read_text())["weight_map"]
    vision_shards = {s for n, s in weight_map.items() if ".visual." in f".{n}"}
    lm_shards = set(weight_map.values()) - vision_shards
    assert vision_shards and lm_shards
    for shard in lm_shards:
        (broken / shard).write_bytes(b"\0not a safetensors file")

    encoder = VisionEncoder(broken)
    report = encoder.load_report
    assert (report.shards_read, report.shards_total) == (len(vision_shards), len(vision_shards) + len(lm_shards))
    assert report.bytes_read < report.bytes_total

    image = decode_image(synthetic_image_png(160, 120, seed=1))
    (_, from_broken), = encoder.encode_images([image])
    (_, from_intact), = VisionEncoder(intact).encode_images([image])
    assert torch.equal(from_broken, from_intact)


def test_pixel_and_frame_limits_name_the_field():
    """Decoded-size limits are checked by the decoder that the encoder and the oracle share."""
    from epd.domain import VideoFrames
    from epd.media import MediaError
    from epd.testing import synthetic_frames_png

    decoder = MediaDecoder.for_model(checkpoint("qwen3_vl"), MediaLimits(max_image_pixels=100 * 80, max_video_frames=5))
    assert decoder.decode(MediaInput.of(Modality.IMAGE, MediaFile(synthetic_image_png(100, 80, seed=1), "image/png"))).size == (100, 80)
    cases = {
        "image.data": MediaInput.of(Modality.IMAGE, MediaFile(synthetic_image_png(101, 80, seed=1), "image/png")),
        "video.file.data": MediaInput.of(Modality.VIDEO, MediaFile(synthetic_video(32, 32, 6, fps=6.0, seed=1), "video/mp4")),
        "video.frames.frames": MediaInput.of(Modality.VIDEO, VideoFrames(tuple(MediaFile(f, "image/png") for f in synthetic_frames_png(32, 32, 6, seed=1)), 6.0)),
    }
    for field, item in cases.items():
        with pytest.raises(MediaError) as info:
            decoder.decode(item)
        assert info.value.field == field, str(info.value)


def test_forwarded_media_layout_comes_from_the_processor_not_the_metadata():
    """The media-forwarding baseline re-derives each item's layout from its media."""
    import asyncio
    import dataclasses

    from epd.domain import EncodedItem, EngineRequest, GridThw, Sampling
    from services.forwarded_media import ForwardedMediaLayout

    model = checkpoint("qwen3_vl")
    encoder = VisionEncoder(model)
    items = [
        MediaInput.of(Modality.IMAGE, MediaFile(synthetic_image_png(150, 110, seed=3), "image/png")),
        MediaInput.of(Modality.VIDEO, MediaFile(synthetic_video(96, 64, 12, fps=8.0, seed=4), "video/mp4")),
    ]
    decoder = MediaDecoder.for_model(model, MediaLimits())
    truth = [
        encoder.family.item_metadata(item.modality, item.content_hash, encoder.encode(item.modality, [decoder.decode(item)])[0]) for item in items
    ]
    # Wrong grids and timestamps in the metadata: the forwarded media must win.
    wrong = [dataclasses.replace(m, grid_thw=GridThw(1, 2, 2), video_timestamps_s=(9.9,) * len(m.video_timestamps_s)) for m in truth]
    request = EngineRequest("r", (1,), tuple(EncodedItem(m, None, item) for m, item in zip(wrong, items, strict=True)), Sampling(max_tokens=1))
    rederived = asyncio.run(ForwardedMediaLayout(model, encoder.family).rederive(request))
    assert [i.metadata for i in rederived.items] == truth
