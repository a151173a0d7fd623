"""bfloat16, the dtype of every GPU deployment: disaggregated greedy tokens equal monolithic bf16
ones, for an image, a video, an audio clip and an Omni prompt mixing audio and an image, on the
Qwen2.5-Omni thinker (one bf16 stack serves all four: CI time is tight). It is the suite's only
Qwen2.5-Omni stack, so these are also that model's equivalence tests. Two families from outside
Qwen get bf16 stacks of their own: LLaVA-NeXT (images) and InternVL 3 (an image and a video).

They can only, because the encoder runs vLLM's own tower. The last test keeps the reason in
view: Hugging Face's tower, given the same image and weights in bf16, rounds differently.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from devkit.media import sine_wav, synthetic_image_png, synthetic_video
from epd import wire
from epd.client import chat_request
from epd.v1 import encoder_pb2_grpc
from tests.conftest import BF16, stack_key
from tests.helpers import assert_matches_monolithic, read_published_rows

OMNI = stack_key("qwen2_5_omni", BF16)
PNG = synthetic_image_png(140, 112, seed=91)

CASES = {
    "image": lambda: [(PNG, "image/png"), "Describe the picture."],
    "video": lambda: [(synthetic_video(96, 64, 12, fps=8.0, seed=92), "video/mp4"), "What happens?"],
    "audio": lambda: [(sine_wav(1.4, freq=410.0, seed=93), "audio/wav"), "What do you hear?"],
    "audio_and_image": lambda: [(sine_wav(0.9, seed=94), "audio/wav"), (synthetic_image_png(120, 96, seed=95), "image/png"), "Both?"],
}


@pytest.mark.parametrize("family", [OMNI])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", ["epd", "epd-combined"])
async def test_bf16_greedy_tokens_match_monolithic(family_stack, family, case, mode):
    await assert_matches_monolithic(family_stack, CASES[case](), mode, max_tokens=24)


NON_QWEN_CASES = {
    stack_key("llava_next", BF16): {
        "two_images": lambda: [(synthetic_image_png(200, 70, seed=96), "image/png"), (PNG, "image/png"), "Compare."],
    },
    stack_key("internvl", BF16): {
        "image_and_video": lambda: [(PNG, "image/png"), (synthetic_video(96, 64, 12, fps=8.0, seed=97), "video/mp4"), "Same scene?"],
    },
}


@pytest.mark.parametrize(("family", "case"), [(family, case) for family, cases in NON_QWEN_CASES.items() for case in cases])
@pytest.mark.parametrize("mode", ["epd", "epd-combined"])
async def test_bf16_non_qwen_greedy_tokens_match_monolithic(family_stack, family, case, mode):
    await assert_matches_monolithic(family_stack, NON_QWEN_CASES[family][case](), mode, max_tokens=24)


def _hf_tower_embedding(model: str) -> torch.Tensor:
    """Hugging Face's vision tower in bf16 on PNG, as an encoder built on it would run it."""
    import io

    import transformers
    from PIL import Image
    from transformers import AutoConfig, AutoProcessor

    processor = AutoProcessor.from_pretrained(model)
    inputs = processor.image_processor(images=[Image.open(io.BytesIO(PNG)).convert("RGB")], return_tensors="pt")
    hf = getattr(transformers, AutoConfig.from_pretrained(model).architectures[0]).from_pretrained(model, dtype=torch.bfloat16)
    hf = getattr(hf, "thinker", hf)  # an Omni model's towers sit in its thinker
    with torch.inference_mode():
        features = hf.get_image_features(inputs["pixel_values"].to(torch.bfloat16), inputs["image_grid_thw"])
    (embedding,) = features.pooler_output
    return embedding


@pytest.mark.parametrize("family", [OMNI])
async def test_hf_tower_bf16_embedding_is_not_vllms(family_stack, family):
    """Why the encoder runs vLLM's tower: Hugging Face's, on the same image and weights in bf16,
    rounds differently. (An earlier EPD fed such embeddings to vLLM and saw greedy tokens leave
    the monolithic run's at token 7 on a tiny Qwen2.5-VL; its Qwen2.5-VL tower is the Omni
    thinker's.)"""
    chat = wire.generate_request_from_wire(chat_request([(PNG, "image/png"), "Describe the picture."], max_tokens=4))
    async with grpc.aio.insecure_channel(family_stack.encoder.address) as channel:
        encoded = await encoder_pb2_grpc.EncoderServiceStub(channel).Encode(wire.encode_request_to_wire("", [chat.media[0]], ""), timeout=60)
    (item,) = encoded.items
    rows, width = item.metadata.embedding_shape
    vllm_rows = read_published_rows(wire.embedding_location_from_wire(item.embedding), rows, width, torch.bfloat16)
    hf_rows = _hf_tower_embedding(family_stack.model)

    # The same computation, rounded differently: close, but not the same bits.
    assert hf_rows.shape == vllm_rows.shape and hf_rows.dtype == vllm_rows.dtype == torch.bfloat16
    assert not torch.equal(hf_rows, vllm_rows)
    assert torch.allclose(hf_rows.float(), vllm_rows.float(), rtol=0.05, atol=0.05)


def test_batch_invariant_mode_is_refused_at_start_on_cpu():
    """vLLM's CPU platform takes VLLM_BATCH_INVARIANT=1 and then fails the first forward pass
    (Triton kernels, no CPU backend): a stage given --batch-invariant on CPU refuses to start,
    saying so, instead of dying at its first request."""
    import pathlib
    import subprocess
    import sys

    from tests.conftest import checkpoint

    command = [sys.executable, "-m", "cli", "prefill", "--model", str(checkpoint("qwen2_5_vl")), "--batch-invariant", "--port", "0"]
    started = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=pathlib.Path(__file__).resolve().parents[1])
    assert started.returncode != 0
    assert "batch-invariant mode (--batch-invariant, VLLM_BATCH_INVARIANT=1) does not run on vLLM's CPU platform" in started.stdout + started.stderr
    assert "EPD_READY" not in started.stdout
