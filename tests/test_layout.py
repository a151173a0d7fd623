"""Placeholders rebuilt from metadata equal the HF processor's own expansion, and the encoder
reads only the vision tower's shards."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from epd.checkpoints import FAMILIES
from epd.domain import ChatMessage, ItemMetadata, MediaInput, Modality, Role, TextPart
from epd.media import decode_image
from epd.models.qwen_vl import VisionEncoder
from epd.testing import synthetic_image_png
from gateway.prompt import PromptRenderer
from tests.conftest import checkpoint

SIZES = [(160, 120, 1), (224, 112, 2), (56, 300, 3)]


def _messages(count: int) -> tuple[ChatMessage, ...]:
    parts: list = [TextPart("First:")]
    for i in range(count):
        parts += [MediaInput(Modality.IMAGE, b"-", "image/png", f"h{i}"), TextPart(f"and {i}")]
    return (ChatMessage(Role.USER, tuple(parts)),)


@pytest.mark.parametrize("family", FAMILIES)
def test_placeholders_rebuilt_from_metadata_equal_processor_expansion(family):
    from transformers import AutoProcessor

    model = checkpoint(family)
    encoder = VisionEncoder(model)
    renderer = PromptRenderer(str(model))
    images = [decode_image(synthetic_image_png(w, h, seed=s)) for w, h, s in SIZES]
    messages = _messages(len(images))

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
