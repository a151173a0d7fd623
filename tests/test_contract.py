"""Contract polish: reflection v1 and v1alpha, buf breaking against the recorded baseline,
stable error texts, and the usage an aborted stream reports.

Real parts only: a real GrpcHost on 127.0.0.1 for reflection, the real buf binary, the shared
Qwen2.5-VL stack (``family_stack``) for abort.
"""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess

import grpc
import pytest
from google.protobuf import descriptor_pb2
from google.rpc import error_details_pb2
from grpc_reflection.v1alpha import reflection_pb2

from devkit.media import synthetic_image_png
from epd.client import chat_request, generate
from epd.errors import DESCRIPTION_BYTES, MAX_VIOLATIONS, MESSAGE_BYTES, FieldViolation, InvalidArgument, client_text, to_rpc_status
from epd.media import MediaError
from epd.media.image import decode_image
from epd.server import GrpcHost, ServerConfig
from epd.v1 import common_pb2, gateway_pb2  # noqa: F401 - registers epd/v1/gateway.proto for reflection
from tests.helpers import wait_for_metric

ROOT = pathlib.Path(__file__).resolve().parents[1]
BUF = ROOT / ".venv" / "bin" / "buf"
BASELINE = ROOT / "protos" / "baseline" / "epd-v1.binpb"

# --- reflection ---------------------------------------------------------------------------

ALL_SERVICES = ["epd.v1.GatewayService", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"]


async def _reflect(channel: grpc.aio.Channel, version: str, requests: list[reflection_pb2.ServerReflectionRequest]) -> list[reflection_pb2.ServerReflectionResponse]:
    """One reflection stream on ``grpc.reflection.<version>``. v1 and v1alpha share their wire
    format (same messages, same field numbers), so v1alpha's classes encode v1 too."""
    call = channel.stream_stream(
        f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    return [response async for response in call(iter(requests), timeout=10)]


def _files(response: reflection_pb2.ServerReflectionResponse) -> dict[str, descriptor_pb2.FileDescriptorProto]:
    """The file descriptors a reflection answer carries, by name, in the order sent."""
    parsed = [descriptor_pb2.FileDescriptorProto.FromString(b) for b in response.file_descriptor_response.file_descriptor_proto]
    return {file.name: file for file in parsed}


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
async def test_reflection_answers_v1_and_v1alpha(version):
    host = GrpcHost(ServerConfig(), service_name="reflection-test", full_service_name="epd.v1.GatewayService")
    await host.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{host.port}") as channel:
            listed, gateway_file, v1_file, missing = await _reflect(
                channel,
                version,
                [
                    reflection_pb2.ServerReflectionRequest(list_services=""),
                    reflection_pb2.ServerReflectionRequest(file_containing_symbol="epd.v1.GatewayService"),
                    reflection_pb2.ServerReflectionRequest(file_containing_symbol="grpc.reflection.v1.ServerReflection"),
                    reflection_pb2.ServerReflectionRequest(file_containing_symbol="epd.v1.NoSuchService"),
                ],
            )
    finally:
        await host.server.stop(0)
    assert sorted(s.name for s in listed.list_services_response.service) == ALL_SERVICES
    files = _files(gateway_file)
    assert files["epd/v1/gateway.proto"].service[0].name == "GatewayService"
    assert {"epd/v1/common.proto", "epd/v1/multimodal.proto", "google/protobuf/duration.proto"} <= files.keys()  # its dependencies come along
    # v1 reflects on itself: its own descriptor, in its own package.
    v1 = next(iter(_files(v1_file).values()))
    assert (v1.name, v1.package) == ("grpc/reflection/v1/reflection.proto", "grpc.reflection.v1")
    method = v1.service[0].method[0]
    assert (method.name, method.input_type, method.output_type) == (
        "ServerReflectionInfo",
        ".grpc.reflection.v1.ServerReflectionRequest",
        ".grpc.reflection.v1.ServerReflectionResponse",
    )
    assert {f.name: f.number for f in v1.message_type[0].field} == {f.name: f.number for f in reflection_pb2.ServerReflectionRequest.DESCRIPTOR.fields}
    assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


# --- buf breaking against the recorded baseline -------------------------------------------


def _buf_breaking(protos: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(BUF), "breaking", str(protos), "--against", str(BASELINE)], capture_output=True, text=True, timeout=120)


def test_the_contract_is_compatible_with_the_baseline():
    done = _buf_breaking(ROOT / "protos")
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        # A renumbered field: every old client would read the wrong value.
        (("uint32 max_tokens = 4;", "uint32 max_tokens = 40;"), r'field "4" with name "max_tokens" on message "SamplingParams" was deleted'),
        # A removed enum value.
        (("  FINISH_REASON_ABORT = 3;\n", ""), r'enum value "3" .*"FinishReason" was deleted'),
        # A changed generated-code option (Go users import the package by this path).
        (('option go_package = "github.com/epd-project/epd/sdk/go/epd/v1;epdv1";', 'option go_package = "github.com/epd-project/epd/sdk/go/epd/v2;epdv1";'), r'File option "go_package" changed'),
    ],
)
def test_buf_breaking_catches_a_break(tmp_path, edit, problem):
    protos = tmp_path / "protos"
    shutil.copytree(ROOT / "protos" / "epd", protos / "epd")
    shutil.copy(ROOT / "protos" / "buf.yaml", protos / "buf.yaml")
    common = protos / "epd" / "v1" / "common.proto"
    old, new = edit
    assert old in common.read_text()
    common.write_text(common.read_text().replace(old, new))
    done = _buf_breaking(protos)
    assert done.returncode != 0
    assert re.search(problem, done.stdout, re.IGNORECASE), done.stdout + done.stderr


# --- stable error texts -------------------------------------------------------------------


def test_undecodable_images_get_one_stable_description():
    descriptions = set()
    for junk in (b"not an image", b"\x89PNG but no more", bytes(64)):
        with pytest.raises(MediaError) as info:
            decode_image(junk, max_pixels=1 << 24)
        descriptions.add(str(info.value))
    assert descriptions == {"is not a decodable image (no image format recognized in its bytes)"}
    with pytest.raises(MediaError, match=r"^is not a decodable image \(image file is truncated\)$"):
        decode_image(synthetic_image_png(64, 64, seed=3)[:120], max_pixels=1 << 24)


def test_statuses_carry_no_reprs_or_dumps_and_are_bounded():
    error = InvalidArgument.for_field("messages[0].parts[0].image.data", "cannot read <_io.BytesIO object at 0x7f0b189f58f0> at all")
    status = to_rpc_status(error)
    assert status.message == "messages[0].parts[0].image.data: cannot read … at all"
    assert "0x" not in status.SerializeToString().decode("latin-1")
    assert client_text("no repr here: 0x10 is a number, and a <= b") == "no repr here: 0x10 is a number, and a <= b"
    assert client_text("missing 'authorization: Bearer <token>' metadata") == "missing 'authorization: Bearer <token>' metadata"
    frames = "[" + ", ".join("<PIL.Image.Image image mode=RGB size=10000x10 at 0x7f3c>" for _ in range(4000)) + "]"
    vllm = f"Failed to apply Qwen2VLProcessor on data={{'videos': {frames}}} with kwargs={{'fps': array([2.0])}}"
    assert client_text(vllm) == "Failed to apply Qwen2VLProcessor on data=… with kwargs=…"
    assert client_text("Unexpected <class 'google.protobuf.message.DecodeError'>: corrupt") == "Unexpected …: corrupt"
    assert client_text("cut short: {'a': [1, 2") == "cut short: …"
    # Bounded in bytes, whatever the script, and at most MAX_VIOLATIONS fields detailed.
    assert len(client_text("é" * 1000).encode()) <= MESSAGE_BYTES
    many = InvalidArgument("bad", [FieldViolation(f"messages[{i}]", "x" * 1000) for i in range(50)])
    status = to_rpc_status(many)
    assert status.message.startswith(f"50 invalid fields, the first {MAX_VIOLATIONS} detailed: ")
    bad_request = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad_request) and len(bad_request.field_violations) == MAX_VIOLATIONS
    assert all(len(v.description.encode()) <= DESCRIPTION_BYTES for v in bad_request.field_violations)
    assert len(status.SerializeToString()) < 4096


# --- an aborted stream's usage ------------------------------------------------------------


async def test_an_aborted_stream_reports_what_it_streamed(family_stack):
    stub = family_stack.gateway_stub("epd")
    parts = [(synthetic_image_png(96, 96, seed=45), "image/png"), "Go on."]
    whole = (await generate(stub, chat_request(parts, max_tokens=2), timeout=120)).finished.usage
    request = chat_request(parts, max_tokens=2000, min_tokens=2000, request_id="abort-usage")
    streamed, events = 0, []
    async for response in stub.Generate(request, timeout=120):
        events.append(response)
        streamed += len(response.delta.token_ids)
        if len(events) == 4:
            await stub.Abort(gateway_pb2.AbortRequest(request_id="abort-usage"), timeout=10)
    finished = events[-1].finished
    assert finished.finish_reason == common_pb2.FINISH_REASON_ABORT
    assert 4 <= streamed < 2000
    assert finished.usage.completion_tokens == streamed
    # The prompt's counts are those of the same chat run to its end.
    assert whole.prompt_tokens > whole.multimodal_tokens > 0
    assert (finished.usage.prompt_tokens, finished.usage.multimodal_tokens) == (whole.prompt_tokens, whole.multimodal_tokens)
    ttft, total = finished.timings.time_to_first_token.ToNanoseconds(), finished.timings.total.ToNanoseconds()
    assert 0 < ttft < total
    stages = [getattr(finished.timings, stage).ToNanoseconds() for stage in ("encode", "prefill", "decode")]
    assert all(0 < t < total for t in stages), stages
    assert await wait_for_metric(family_stack.decode.metrics_port, "epd_requests_in_flight", 0.0) == 0.0
