"""Pure logic at the edge: request validation, conversions and status details (no engines)."""

from __future__ import annotations

import dataclasses
import hashlib

import grpc
import pytest
from google.rpc import error_details_pb2

from epd import wire
from epd.domain import (
    EngineField,
    EngineRequest,
    GridThw,
    InlineEmbedding,
    ItemMetadata,
    KvHandoff,
    MediaFile,
    MediaInput,
    Modality,
    NixlLocation,
    PcmAudio,
    PcmEncoding,
    VideoFrames,
    VideoSampling,
)
from epd.errors import InvalidArgument, ResourceExhausted, to_rpc_status
from epd.mm_items import batch_fields, engine_field_from_vllm, metadata_from_published, vllm_fields
from epd.transport.connector.ec_params import (
    ExpectedItem,
    PublishedItem,
    expected_from_params,
    expected_to_params,
    published_from_params,
    published_to_params,
)
from epd.v1 import common_pb2, engine_pb2, gateway_pb2, multimodal_pb2


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


def test_a_cache_salt_reaches_the_engines_and_is_bounded():
    request = _request([gateway_pb2.ContentPart(text="hi")])
    request.cache_salt = "tenant-7"
    salted = wire.generate_request_from_wire(request)
    assert salted.cache_salt == "tenant-7"
    engine_request = EngineRequest("r", (), salted.sampling, chat=salted.engine_chat(), cache_salt=salted.cache_salt)
    assert wire.prefill_request_from_wire(wire.prefill_request_to_wire(engine_request)).cache_salt == "tenant-7"
    assert wire.decode_request_from_wire(wire.decode_request_to_wire(engine_request)).cache_salt == "tenant-7"

    request.cache_salt = "s" * (wire.MAX_CACHE_SALT_CHARS + 1)
    with pytest.raises(InvalidArgument) as info:
        wire.generate_request_from_wire(request)
    assert _fields(info.value) == ["cache_salt"]
    forged = wire.prefill_request_to_wire(dataclasses.replace(engine_request, cache_salt=request.cache_salt))
    with pytest.raises(InvalidArgument) as info:
        wire.prefill_request_from_wire(forged)
    assert _fields(info.value) == ["prompt.cache_salt"]


def test_media_without_bytes_or_mime_names_the_part():
    with pytest.raises(InvalidArgument) as info:
        wire.generate_request_from_wire(_request([gateway_pb2.ContentPart(text="hi"), gateway_pb2.ContentPart(image=multimodal_pb2.Media())]))
    assert _fields(info.value) == ["messages[0].parts[1].image.data", "messages[0].parts[1].image.mime_type"]


def test_the_gateway_routes_media_by_a_key_of_its_own_and_leaves_the_content_hash_to_the_encoder():
    frames = (MediaFile(b"frame one", "image/png"), MediaFile(b"frame two", "image/png"))
    clip = MediaInput(Modality.VIDEO, VideoFrames(frames, 2.0))
    keys = {
        clip.affinity_key,
        MediaInput(Modality.VIDEO, VideoFrames(frames, 2.0), VideoSampling(fps=1.0)).affinity_key,
        MediaInput(Modality.VIDEO, VideoFrames(frames, 4.0)).affinity_key,
        MediaInput(Modality.VIDEO, VideoFrames((MediaFile(b"frame on", "image/png"), MediaFile(b"eframe two", "image/png")), 2.0)).affinity_key,
    }
    assert len(keys) == 4  # options and frame boundaries count, as in the content hash
    assert MediaInput(Modality.VIDEO, VideoFrames(frames, 2.0)).affinity_key == clip.affinity_key

    request = wire.generate_request_from_wire(_request([gateway_pb2.ContentPart(image=multimodal_pb2.Media(data=b"png bytes", mime_type="image/png"))]))
    image = request.media[0]
    assert "affinity_key" in vars(image)  # computed as the request was built, off the event loop for a large one
    (sent,) = wire.encode_request_to_wire("r", [image], "k").items
    assert not sent.content_hash and "content_hash" not in vars(image)  # the gateway hashed nothing but its key
    received = wire.media_items_from_wire([sent])[0]
    assert "content_hash" in vars(received)  # hashed as it was parsed (the encoder parses off its event loop)
    assert received.content_hash == hashlib.sha256(b"png bytes").hexdigest()


def test_every_kind_of_media_reaches_the_encoder_as_it_came():
    frames = (MediaFile(b"frame one", "image/png"), MediaFile(b"frame two", "image/jpeg"))
    items = [
        MediaInput(Modality.IMAGE, MediaFile(b"png", "image/png")),
        MediaInput(Modality.VIDEO, MediaFile(b"mp4", "video/mp4"), VideoSampling(fps=1.5, max_frames=12)),
        MediaInput(Modality.VIDEO, MediaFile(b"webm", "video/webm")),
        MediaInput(Modality.VIDEO, VideoFrames(frames, 2.0), VideoSampling(max_frames=4)),
        MediaInput(Modality.AUDIO, MediaFile(b"wav", "audio/wav")),
        MediaInput(Modality.AUDIO, PcmAudio(b"\x00\x01" * 8, 8000, 2, PcmEncoding.S16LE)),
    ]
    sent = wire.encode_request_to_wire("r", items, "release")
    assert (sent.request_id, sent.release_key) == ("r", "release")
    received = wire.media_items_from_wire(list(sent.items))
    assert [(m.modality, m.source, m.video_sampling) for m in received] == [(m.modality, m.source, m.video_sampling) for m in items]
    assert [m.content_hash for m in received] == [m.content_hash for m in items]


def test_metadata_round_trips_with_typed_and_engine_fields():
    meta = ItemMetadata(
        Modality.VIDEO,
        "ab" * 32,
        7,
        6,
        9,
        (6, 128),
        "bfloat16",
        GridThw(2, 4, 6),
        video_timestamps_s=(0.25, 1.25),
        second_per_grid_ts=0.5,
        engine_fields={
            "use_audio_in_video": EngineField("bool", (), (0,)),
            "scales": EngineField("float32", (2,), (0.5, 2.0)),
            "second_per_grid_ts": EngineField("bfloat16", (), (0.75,)),  # a bf16 model's: not the typed float32 form
        },
    )
    assert wire.metadata_from_wire(wire.metadata_to_wire(meta), "m") == meta


def test_metadata_with_inconsistent_shape_or_field_values_names_them():
    msg = wire.metadata_to_wire(ItemMetadata(Modality.IMAGE, "ab" * 32, 7, 6, 6, (6, 16), "float32", GridThw(1, 4, 6)))
    msg.embedding_shape[0] = 5
    msg.engine_fields["x"].dtype = multimodal_pb2.FIELD_DTYPE_INT64
    msg.engine_fields["x"].shape.extend([3])
    msg.engine_fields["x"].int_values.extend([1, 2])
    with pytest.raises(InvalidArgument) as info:
        wire.metadata_from_wire(msg, "items[0].metadata")
    assert _fields(info.value) == ["items[0].metadata.embedding_shape", "items[0].metadata.engine_fields['x']"]


def test_metadata_fields_are_bounded_before_any_engine_reads_them():
    def metadata(**fields) -> multimodal_pb2.MultimodalMetadata:
        msg = wire.metadata_to_wire(ItemMetadata(Modality.IMAGE, "ab" * 32, 7, 6, 6, (6, 16), "float32", GridThw(1, 4, 6)))
        for name, (dtype, values) in fields.items():
            value = msg.engine_fields[name]
            value.dtype = dtype
            value.shape.append(len(values))
            (value.float_values if dtype == multimodal_pb2.FIELD_DTYPE_FLOAT64 else value.int_values).extend(values)
        return msg

    int64, float64 = multimodal_pb2.FIELD_DTYPE_INT64, multimodal_pb2.FIELD_DTYPE_FLOAT64
    refused = {
        "items[0].metadata.engine_fields": metadata(**{"no spaces": (int64, [1])}),
        "items[0].metadata.engine_fields['lengths']": metadata(lengths=(int64, [2**24])),
        "items[0].metadata.engine_fields['grid']": metadata(grid=(int64, [2**11, 2**11, 2**11])),
        "items[0].metadata.engine_fields['seconds']": metadata(seconds=(float64, [float("nan")])),
    }
    for field, msg in refused.items():
        with pytest.raises(InvalidArgument) as info:
            wire.metadata_from_wire(msg, "items[0].metadata")
        assert _fields(info.value) == [field]
    many = metadata(**{f"f{i}": (int64, [i]) for i in range(33)})
    with pytest.raises(InvalidArgument) as info:
        wire.metadata_from_wire(many, "items[0].metadata")
    assert _fields(info.value) == ["items[0].metadata.engine_fields"]
    kept = wire.metadata_from_wire(metadata(grid=(int64, [1, 2**10, 2**10]), seconds=(float64, [0.5])), "items[0].metadata")
    assert kept.engine_fields["grid"].values == (1, 1024, 1024)


def test_published_fields_become_typed_only_when_exact():
    """vLLM's well-known fields become typed fields when the typed form gives back exactly what
    vLLM held; others (and mismatching forms) ride verbatim; both reach the consumer intact."""
    import torch

    published = {
        "image_grid_thw": engine_field_from_vllm(torch.tensor([1, 4, 6])),
        "second_per_grid_ts": engine_field_from_vllm(torch.tensor(0.5, dtype=torch.float64)),  # not vLLM's float32: kept verbatim
        "custom_sizes": engine_field_from_vllm(torch.tensor([[3, 4]], dtype=torch.int32)),
    }
    item = PublishedItem("image", 6, 16, "float32", 8, 7, published, False, InlineEmbedding(b""))
    meta = metadata_from_published("h", item)
    assert meta.grid_thw == GridThw(1, 4, 6) and meta.second_per_grid_ts is None
    assert set(meta.engine_fields) == {"second_per_grid_ts", "custom_sizes"}
    rebuilt = vllm_fields(meta, {"image_grid_thw", "second_per_grid_ts", "custom_sizes"}, "items[0].metadata")
    for name, value in rebuilt.items():
        original = published[name]
        assert engine_field_from_vllm(value) == original, name
    with pytest.raises(InvalidArgument) as info:
        vllm_fields(meta, {"timestamps", "pixel_sizes"}, "items[0].metadata")
    assert _fields(info.value) == ["items[0].metadata.engine_fields['pixel_sizes']", "items[0].metadata.video_timestamps_s"]


def test_items_are_batched_per_field_as_vllm_takes_them():
    import torch

    same = batch_fields([{"grid": torch.tensor([1, 2, 2])}, {"grid": torch.tensor([1, 4, 2])}])
    assert same["grid"].shape == (2, 3)
    ragged = batch_fields([{"timestamps": [0.5, 1.5]}, {"timestamps": [0.5]}])
    assert ragged["timestamps"] == [[0.5, 1.5], [0.5]]


def test_ec_params_round_trip_and_reject_foreign_entries():
    location = NixlLocation("agent", "127.0.0.1:5", b"\x01" + b"\x00" * 20, 120, "ab" * 16, 2**64 - 1, 1_000, b"\x07" * 32)
    fields = {"image_grid_thw": EngineField("int64", (3,), (1, 2, 2))}
    published = {"h": PublishedItem("image", 1, 16, "bfloat16", 1, 9, fields, False, location)}
    assert published_from_params(published_to_params(published)) == published
    expected = {"h": ExpectedItem(1, 16, "bfloat16", InlineEmbedding(b"\x00" * 32))}
    assert expected_from_params(expected_to_params(expected)) == expected
    for foreign in ({"h": {"epd": {"version": 2}}}, {"h": "x"}, ["h"]):
        with pytest.raises(ValueError):
            expected_from_params(foreign)


def test_rich_status_details():
    status = to_rpc_status(InvalidArgument.for_field("sampling.max_tokens", "must be at least 1"))
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    detail = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(detail)
    assert detail.field_violations[0].field == "sampling.max_tokens"
    retry = error_details_pb2.RetryInfo()
    assert to_rpc_status(ResourceExhausted("full", retry_after_s=0.5)).details[0].Unpack(retry)
    assert retry.retry_delay.ToMilliseconds() == 500


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -0.5, 2.5])
def test_temperature_outside_zero_to_two_or_not_a_number_is_refused(temperature):
    request = _request([gateway_pb2.ContentPart(text="hi")])
    request.sampling.temperature = temperature
    with pytest.raises(InvalidArgument) as info:
        wire.generate_request_from_wire(request)
    assert _fields(info.value) == ["sampling.temperature"]


@pytest.mark.parametrize(("frames_fps", "sampling_fps", "field"), [
    (1e-300, 0.0, "messages[0].parts[0].video.frames.fps"),
    (float("nan"), 0.0, "messages[0].parts[0].video.frames.fps"),
    (1e6, 0.0, "messages[0].parts[0].video.frames.fps"),
    (24.0, float("nan"), "messages[0].parts[0].video.sampling.fps"),
    (24.0, -1.0, "messages[0].parts[0].video.sampling.fps"),
])
def test_absurd_frame_rates_are_refused(frames_fps, sampling_fps, field):
    frame = multimodal_pb2.Media(data=b"\x89PNG", mime_type="image/png")
    video = multimodal_pb2.Video(frames=multimodal_pb2.VideoFrames(frames=[frame], fps=frames_fps), sampling=multimodal_pb2.VideoSampling(fps=sampling_fps))
    with pytest.raises(InvalidArgument) as info:
        wire.generate_request_from_wire(_request([gateway_pb2.ContentPart(video=video), gateway_pb2.ContentPart(text="hi")]))
    assert _fields(info.value) == [field]


def _handoff(**changes):
    handoff = engine_pb2.KvHandoff(
        remote_engine_id="e", remote_block_groups=[engine_pb2.KvBlockGroup(block_ids=[1, 2])], remote_host="127.0.0.1", remote_port=5600, remote_request_id="r", tp_size=1
    )
    for name, value in changes.items():
        if name == "remote_block_groups":
            del handoff.remote_block_groups[:]
            handoff.remote_block_groups.extend(value)
        else:
            setattr(handoff, name, value)
    return handoff


def test_a_well_formed_kv_handoff_is_taken():
    taken = wire.kv_handoff_from_wire(_handoff(expires_at_unix_ms=1_800_000_000_123))
    assert taken.remote_block_groups == ((1, 2),) and taken.expires_at_unix_ms == 1_800_000_000_123
    assert wire.kv_handoff_to_wire(taken) == _handoff(expires_at_unix_ms=1_800_000_000_123)


@pytest.mark.parametrize(("changes", "field"), [
    ({"remote_block_groups": []}, "kv_handoff.remote_block_groups"),
    ({"remote_block_groups": [engine_pb2.KvBlockGroup()]}, "kv_handoff.remote_block_groups"),
    ({"remote_port": 0}, "kv_handoff.remote_port"),
    ({"remote_port": 70000}, "kv_handoff.remote_port"),
    ({"remote_host": ""}, "kv_handoff.remote_host"),
    ({"remote_engine_id": ""}, "kv_handoff.remote_engine_id"),
    ({"remote_request_id": ""}, "kv_handoff.remote_request_id"),
    ({"tp_size": 0}, "kv_handoff.tp_size"),
])
def test_a_forged_kv_handoff_is_refused_at_the_edge(changes, field):
    """vLLM's connector trusts these values: an empty block list made a decode engine core exit."""
    with pytest.raises(InvalidArgument) as info:
        wire.kv_handoff_from_wire(_handoff(**changes))
    assert _fields(info.value) == [field]


def test_cancelled_at_the_deadline_is_deadline_exceeded_and_otherwise_unavailable():
    """A stage's server may cancel a stream as the shared deadline runs out, a moment before the
    client's own timer: that must not read as a retryable failure."""
    import time

    from epd.errors import DeadlineExceeded, Unavailable, from_rpc_error

    cancelled = grpc.aio.AioRpcError(grpc.StatusCode.CANCELLED, grpc.aio.Metadata(), grpc.aio.Metadata(), details="Received RST_STREAM")
    assert isinstance(from_rpc_error(cancelled, peer="decode", deadline=time.monotonic() + 0.1), DeadlineExceeded)
    assert type(from_rpc_error(cancelled, peer="decode", deadline=time.monotonic() + 30)) is Unavailable
    assert type(from_rpc_error(cancelled, peer="decode")) is Unavailable


def test_a_sealed_handoff_verifies_across_the_wire_and_nothing_altered_does():
    """The seal covers the handoff's wire form: it must survive the trip (extra parameters
    become a Struct of doubles and come back as ints), and any field changed breaks it."""
    from services.engine_stage import HandoffSeal

    handoff = KvHandoff(
        remote_engine_id="prefill-1",
        remote_block_groups=((3, 4, 5),),
        remote_host="10.0.0.8",
        remote_port=5600,
        remote_request_id="r-prefill-0a1b",
        remote_num_tokens=300,
        tp_size=1,
        extra_params={"dcp_size": 1, "pp_size": 1, "transfer_mode": "pull", "remote_prefill_cached_tokens": 0, "remote_blocks_expiry_time": None},
        expires_at_unix_ms=1_800_000_000_000,
    )
    seal = HandoffSeal(b"k" * 32)
    sealed = seal.sealed(handoff)
    arrived = wire.kv_handoff_from_wire(engine_pb2.KvHandoff.FromString(wire.kv_handoff_to_wire(sealed).SerializeToString()))
    seal.check(arrived)
    for change in ({"remote_block_groups": ((3, 4, 6),)}, {"remote_request_id": "r-prefill-0a1c"}, {"expires_at_unix_ms": 1_800_000_001_000}, {"seal": b""}):
        with pytest.raises(InvalidArgument) as refused:
            seal.check(dataclasses.replace(arrived, **change))
        assert [v.field for v in refused.value.violations] == ["kv_handoff.seal"]
    with pytest.raises(InvalidArgument):
        HandoffSeal(b"another key").check(arrived)
    HandoffSeal(None).check(handoff)  # no key: nothing is checked
    assert HandoffSeal(None).sealed(handoff) == handoff
