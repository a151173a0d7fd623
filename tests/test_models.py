"""Models beyond the Qwen-VL pair, with no code of ours per model: the Qwen2.5-Omni and Qwen3-Omni
thinkers, NVIDIA's Audio Flamingo 3, LLaVA-NeXT, GLM-4.1V, InternVL 3, Mistral 3, Idefics3
(SmolVLM v1's architecture) and Gemma 3. Greedy tokens equal the monolithic vLLM run of the same
request in E/P/D and E+PD (``test_equivalence.py`` compares every mode with vLLM's own
``LLM.chat``).

Every modality of these is metadata-only: no media reaches prefill or decode. vLLM declares the
layout of Qwen2.5-Omni's, Qwen3-Omni's audio and Audio Flamingo 3's; EPD declares what vLLM 0.32
leaves out (Qwen2.5-Omni's ``second_per_grid_ts``, Qwen3-Omni's image and video, LLaVA-NeXT's,
Mistral 3's, Idefics3's and Gemma 3's image, GLM-4.1V's and InternVL's image and video:
``epd/compat/``), and the recording proxy proves it for the Omni thinkers and every family from
outside Qwen that takes images.

Qwen2.5-Omni runs on one stack, in bfloat16 (the deployment dtype, where rounding makes identity
hardest): its audio, image, video and audio-plus-image equivalence is ``test_bf16.py``'s, and its
metadata-only path is checked here on the same stack. A second, float32 stack of the same model
cost CI two minutes and proved nothing the other families' float32 stacks do not.
"""

from __future__ import annotations

import grpc
import pytest

from devkit.media import sine_wav, synthetic_image_png, synthetic_video
from epd.client import chat_request, generate
from epd.v1 import decode_pb2, encoder_pb2, encoder_pb2_grpc, multimodal_pb2, prefill_pb2
from tests.conftest import BF16, stack_key
from tests.helpers import MIN_TOKENS, assert_matches_monolithic, wait_for_metric
from tests.tap import generate_through_taps


def _image(seed: int, width: int = 140, height: int = 100) -> tuple[bytes, str]:
    return synthetic_image_png(width, height, seed=seed), "image/png"


def _clip(seed: int) -> tuple[bytes, str]:
    return synthetic_video(96, 64, 12, fps=8.0, seed=seed), "video/mp4"


def _tone(seconds: float, seed: int) -> tuple[bytes, str]:
    return sine_wav(seconds, freq=300.0 + 40 * seed, seed=seed), "audio/wav"


def _wide_and_tall(seed: int) -> list:
    return [_image(seed, 200, 60), _image(seed + 1, 80, 150), "Compare them."]


# What the chats of test_equivalence.py (every mode against LLM.chat) do not hold: a wide and a
# tall image in one prompt (other tile grids, grids or tile counts than the chats' near-square
# images), an image beside a video, audio beside a video, a longer clip.
CASES = {
    "qwen3_omni_moe": {"audio_and_video": lambda: [_tone(0.9, 8), _clip(9), "Describe both."]},
    "audioflamingo3": {"longer_clip": lambda: [_tone(3.1, 11), "Transcribe."]},
    "llava_next": {"wide_and_tall_images": lambda: _wide_and_tall(30)},
    "glm4v": {
        "wide_and_tall_images": lambda: _wide_and_tall(40),
        "image_and_video": lambda: [_image(45, 90, 150), "and", _clip(46), "Same scene?"],
    },
    "internvl": {
        "wide_and_tall_images": lambda: _wide_and_tall(50),
        "image_and_video": lambda: ["First:", _image(54, 200, 60), "then:", _clip(55), "Same scene?"],
    },
    "mistral3": {"wide_and_tall_images": lambda: _wide_and_tall(60)},
    "idefics3": {"wide_and_tall_images": lambda: _wide_and_tall(70)},
    "gemma3": {"wide_and_tall_images": lambda: _wide_and_tall(80)},
}
PARAMS = [(family, case) for family, cases in CASES.items() for case in cases]


# Shards an encoder reads of the three of each tiny checkpoint: the tower's alone, except where
# vLLM builds the LM head outside the language model (Idefics3), which then loads the head's shard.
SHARDS_READ = {"idefics3": 2}


# The families whose layout vLLM declares itself and whose media path no other test taps: a
# request through recording proxies shows prefill and decode get metadata only.
VLLM_DECLARED_MEDIA = {
    "qwen3_vl": lambda: [_image(90, 160, 90), _clip(91)],
    "qwen2_audio": lambda: [_tone(1.0, 92), _tone(0.6, 93)],
    "audioflamingo3": lambda: [_tone(1.0, 94)],
}


@pytest.mark.parametrize("family", sorted({*CASES, *VLLM_DECLARED_MEDIA, stack_key("qwen2_5_omni", BF16)}))
def test_the_encoder_reads_only_the_tower_shard(family_stack, family):
    """vLLM's encoder-only engine skips every shard that holds language-model weights alone."""
    read = SHARDS_READ.get(family, 1)
    assert f"read {read} of 3 safetensors shards" in family_stack.encoder.log_path.read_text(errors="replace")


@pytest.mark.parametrize(("family", "case"), PARAMS)
@pytest.mark.parametrize("mode", ["epd", "epd-combined"])
async def test_greedy_tokens_match_monolithic(family_stack, family, case, mode):
    await assert_matches_monolithic(family_stack, CASES[family][case](), mode)


@pytest.mark.parametrize("family", ["qwen3_omni_moe"])
async def test_the_encoder_lays_out_every_qwen3_omni_modality_metadata_only(family_stack, family):
    """vLLM 0.32 declares a metadata-only layout for Qwen3-Omni audio only; with EPD's declaration
    of its image and video (epd/compat/vllm_qwen3_omni_vision.py) no item needs its media."""
    items = [
        multimodal_pb2.MediaItem(audio=multimodal_pb2.Audio(file=multimodal_pb2.Media(data=_tone(1.0, 13)[0], mime_type="audio/wav"))),
        multimodal_pb2.MediaItem(image=multimodal_pb2.Media(data=_image(14)[0], mime_type="image/png")),
        multimodal_pb2.MediaItem(video=multimodal_pb2.Video(file=multimodal_pb2.Media(data=_clip(20)[0], mime_type="video/mp4"))),
    ]
    async with grpc.aio.insecure_channel(family_stack.encoder.address) as channel:
        stub = encoder_pb2_grpc.EncoderServiceStub(channel)
        response = await stub.Encode(encoder_pb2.EncodeRequest(items=items), timeout=60)
        await stub.ReleaseEmbeddings(encoder_pb2.ReleaseEmbeddingsRequest(lease_ids=[i.embedding.nixl.lease_id for i in response.items]))
    audio, image, video = (item.metadata for item in response.items)
    assert not audio.layout_needs_media and audio.audio_feature_length > 0
    assert not image.layout_needs_media and image.grid_thw.h > 0
    assert not video.layout_needs_media and video.grid_thw.t > 0 and video.second_per_grid_ts > 0
    assert list(video.engine_fields["use_audio_in_video"].int_values) == [0]  # the thinker reads it from every video


async def _items_past_the_encoder(family_stack, media: list, question: str) -> tuple[list, list]:
    """E/P/D through recording proxies: the tokens equal monolithic's and no media bytes reach
    prefill or decode. Returns the items prefill and decode were sent."""
    request = chat_request([*media, question], max_tokens=16, min_tokens=MIN_TOKENS)
    oracle = await generate(family_stack.gateway_stub("monolithic"), request, timeout=180)
    result, (prefill_body,), (decode_body,) = await generate_through_taps(family_stack, request, "epd")
    assert result.token_ids == oracle.token_ids
    assert all(data[:64] not in body for data, _ in media for body in (prefill_body, decode_body))
    return list(prefill_pb2.PrefillRequest.FromString(prefill_body).items), list(decode_pb2.DecodeRequest.FromString(decode_body).items)


@pytest.mark.parametrize("family", [stack_key("qwen2_5_omni", BF16), "qwen3_omni_moe"])
async def test_omni_metadata_only_path_carries_no_media(family_stack, family):
    """Audio, image and video of an Omni thinker reach decode as metadata only."""
    _, (audio, image, video) = await _items_past_the_encoder(family_stack, [_tone(1.0, 15), _image(16), _clip(21)], "All three?")
    assert audio.metadata.audio_feature_length > 0 and not audio.HasField("forwarded_media")
    assert image.metadata.grid_thw.h > 0 and not image.HasField("forwarded_media")
    assert video.metadata.grid_thw.t > 0 and not video.HasField("forwarded_media")
    assert await wait_for_metric(family_stack.encoder.metrics_port, "epd_arena_leases", 0.0) == 0.0


@pytest.mark.parametrize("family", list(VLLM_DECLARED_MEDIA))
async def test_items_vllm_declares_reach_prefill_and_decode_as_metadata_only(family_stack, family):
    media = VLLM_DECLARED_MEDIA[family]()
    for items in await _items_past_the_encoder(family_stack, media, "What is it?"):
        assert len(items) == len(media)
        assert not any(item.metadata.layout_needs_media or item.HasField("forwarded_media") for item in items)


# Two images each family lays out differently (wide, then tall or square), and a video where the
# family takes one.
DECLARED_LAYOUT_MEDIA = {
    "llava_next": lambda: [_image(34, 200, 70), _image(35, 70, 180)],
    "glm4v": lambda: [_image(34, 200, 70), _image(35, 70, 180), _clip(36)],
    "internvl": lambda: [_image(34, 200, 70), _image(35, 120, 120), _clip(36)],
    # A wide and a square image: Pixtral's and Idefics3's layouts of a wide and a tall image
    # are transposes of each other, with as many tokens.
    "mistral3": lambda: [_image(34, 200, 70), _image(35, 120, 120)],
    "idefics3": lambda: [_image(34, 200, 70), _image(35, 120, 120)],
    "gemma3": lambda: [_image(34, 200, 70), _image(35, 120, 120)],
}


@pytest.mark.parametrize("family", list(DECLARED_LAYOUT_MEDIA))
async def test_items_declared_by_epd_reach_prefill_and_decode_as_metadata_only(family_stack, family):
    """vLLM 0.32 declares no metadata-only layout for LLaVA-NeXT's, GLM-4.1V's, InternVL's,
    Mistral 3's, Idefics3's and Gemma 3's images, nor GLM-4.1V's and InternVL's videos; with EPD's
    declarations (epd/compat/vllm_llava_next.py, vllm_idefics3.py and vllm_gemma3.py: the
    original size; vllm_glm4v.py: the patch grid, and a video's sampling; vllm_internvl.py: the
    tile counts; vllm_mistral3.py: the processed size) the encoder publishes what lays each item
    out, and prefill and decode lay it out from that: neither sees a pixel."""
    for items in await _items_past_the_encoder(family_stack, DECLARED_LAYOUT_MEDIA[family](), "Which is wider?"):
        if family == "llava_next":
            sizes = [list(item.metadata.engine_fields["image_sizes"].int_values) for item in items]
            assert sizes == [[70, 200], [180, 70]]  # (height, width), as the processor records them
        elif family in ("idefics3", "gemma3"):
            sizes = [list(item.metadata.engine_fields["image_sizes"].int_values) for item in items]
            assert sizes == [[70, 200], [120, 120]]  # (height, width) of the original image
        elif family == "mistral3":
            sizes = [list(item.metadata.engine_fields["image_sizes"].int_values) for item in items]
            assert sizes == [[56, 112], [112, 112]]  # (height, width) fitted within 112 px, in whole merged patches
        elif family == "internvl":
            tiles = [list(item.metadata.engine_fields[f"{kind}_num_patches"].int_values) for item, kind in zip(items, ("image", "image", "video"), strict=True)]
            # Tiles and a thumbnail: 3 x 1 for the wide image, 2 x 2 for the square one; a tile a frame.
            assert tiles[:2] == [[4], [5]] and tiles[2][0] > 1
        else:
            grids = [(item.metadata.grid_thw.t, item.metadata.grid_thw.h, item.metadata.grid_thw.w) for item in items]
            assert grids[0][0] == grids[1][0] == 1 and grids[0][2] > grids[0][1] and grids[1][1] > grids[1][2]  # wide, then tall
            # The video's sampling, from which vLLM writes each frame group's timestamp.
            video = items[2].metadata.engine_fields
            assert list(video["video_frames_indices"].int_values) and video["video_fps"].float_values[0] > 0
        assert not any(item.metadata.layout_needs_media or item.HasField("forwarded_media") for item in items)
        # The two images are laid out differently, so they take different token counts (Gemma 3:
        # the same, unless a request turns pan and scan on).
        counts = [item.metadata.placeholder_count for item in items[:2]]
        assert counts[0] == counts[1] if family == "gemma3" else counts[0] != counts[1]
    assert await wait_for_metric(family_stack.encoder.metrics_port, "epd_arena_leases", 0.0) == 0.0
