"""Pure logic at the edge: request validation, conversions and status details (no engines)."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2

from epd import wire
from epd.domain import GridThw, ItemMetadata, Modality, TokenRange
from epd.errors import InvalidArgument, ResourceExhausted, to_rpc_status
from epd.models.qwen_vl import QwenVLFamily
from epd.v1 import common_pb2, gateway_pb2, multimodal_pb2


def _request(parts, max_tokens=8):
    return gateway_pb2.GenerateRequest(
        messages=[gateway_pb2.ChatMessage(role=gateway_pb2.ROLE_USER, parts=parts)],
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens),
    )


def _fields(exc: InvalidArgument) -> list[str]:
    return [v.field for v in exc.violations]


def test_empty_prompt_and_zero_max_tokens_are_reported_together():
    with pytest.raises(InvalidArgument) as info:
        wire.generate_request_from_wire(_request([gateway_pb2.ContentPart(text="  ")], max_tokens=0))
    assert _fields(info.value) == ["messages", "sampling.max_tokens"]


def test_media_without_bytes_or_mime_names_the_part():
    with pytest.raises(InvalidArgument) as info:
        wire.generate_request_from_wire(_request([gateway_pb2.ContentPart(text="hi"), gateway_pb2.ContentPart(image=multimodal_pb2.Media())]))
    assert _fields(info.value) == ["messages[0].parts[1].image.data", "messages[0].parts[1].image.mime_type"]


def test_metadata_round_trips():
    meta = ItemMetadata(
        Modality.IMAGE, "ab" * 32, 7, 6, (6, 128), "bfloat16", GridThw(1, 4, 6), TokenRange(3, 6), engine_extras={"k": "v"}
    )
    assert wire.metadata_from_wire(wire.metadata_to_wire(meta), "m") == meta


def test_rich_status_details():
    status = to_rpc_status(InvalidArgument.for_field("sampling.max_tokens", "must be at least 1"))
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    detail = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(detail)
    assert detail.field_violations[0].field == "sampling.max_tokens"
    retry = error_details_pb2.RetryInfo()
    assert to_rpc_status(ResourceExhausted("full", retry_after_s=0.5)).details[0].Unpack(retry)
    assert retry.retry_delay.ToMilliseconds() == 500


def test_layout_validation_names_inconsistent_fields():
    family = QwenVLFamily(
        "qwen2_5_vl", "unused", image_token_id=9, video_token_id=10, vision_start_token_id=7, vision_end_token_id=8,
        spatial_merge_size=2, embedding_width=16, supported_modalities=frozenset({Modality.IMAGE}),
    )
    good = ItemMetadata(Modality.IMAGE, "h", 9, 6, (6, 16), "float32", GridThw(1, 4, 6))
    assert family.expand_prompt([1, 9, 2], [good]).token_ids == [1] + [9] * 6 + [2]
    bad = ItemMetadata(Modality.IMAGE, "h", 9, 5, (5, 16), "float32", GridThw(1, 4, 6))
    with pytest.raises(InvalidArgument) as info:
        family.expand_prompt([1, 9, 9, 2], [bad])
    assert _fields(info.value) == ["prompt.token_ids", "items[0].metadata.placeholder_count", "items[0].metadata.embedding_shape"]
