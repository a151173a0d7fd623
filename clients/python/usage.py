"""A typed Python client of the EPD gateway on the ``epd-client`` SDK (sdk/python).

Needs only the SDK (``pip install sdk/python`` after ``scripts/gen_sdks.sh``): no vLLM, no torch.
CI type-checks this file with ``mypy --strict`` against the installed SDK, so it shows the SDK's
stubs at work; run it against a gateway with::

    python clients/python/usage.py --gateway 127.0.0.1:50051 --image cat.png "Describe this"
"""

from __future__ import annotations

import argparse
import mimetypes
import pathlib
import sys

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from epd.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, multimodal_pb2


def image_request(image: bytes, mime_type: str, prompt: str, max_tokens: int) -> gateway_pb2.GenerateRequest:
    """One user message, an image then text, decoded greedily (an unset temperature means 1.0)."""
    parts = [
        gateway_pb2.ContentPart(image=multimodal_pb2.Media(data=image, mime_type=mime_type)),
        gateway_pb2.ContentPart(text=prompt),
    ]
    return gateway_pb2.GenerateRequest(
        messages=[gateway_pb2.ChatMessage(role=gateway_pb2.ROLE_USER, parts=parts)],
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )


def field_violations(error: grpc.RpcError) -> list[tuple[str, str]]:
    """The (field, description) pairs of the status's google.rpc.BadRequest details."""
    status = rpc_status.from_call(error) if isinstance(error, grpc.Call) else None
    found: list[tuple[str, str]] = []
    if status is None:  # no grpc-status-details-bin trailer
        return found
    for detail in status.details:
        bad_request = error_details_pb2.BadRequest()
        if detail.Unpack(bad_request):
            found += [(v.field, v.description) for v in bad_request.field_violations]
    return found


def generate(stub: gateway_pb2_grpc.GatewayServiceStub, request: gateway_pb2.GenerateRequest, timeout_s: float) -> tuple[list[int], gateway_pb2.GenerateFinished]:
    """Streams the reply, printing its text; returns the token ids and the final message."""
    token_ids: list[int] = []
    finished = gateway_pb2.GenerateFinished()
    for response in stub.Generate(request, timeout=timeout_s):
        if response.HasField("delta"):
            token_ids += response.delta.token_ids
            print(response.delta.text, end="", flush=True)
        else:
            finished = response.finished
    return token_ids, finished


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gateway", default="127.0.0.1:50051")
    parser.add_argument("--image", type=pathlib.Path, required=True)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("prompt", nargs="?", default="Describe this image.")
    args = parser.parse_args(argv)
    mime_type = mimetypes.guess_type(args.image.name)[0] or "image/png"
    request = image_request(args.image.read_bytes(), mime_type, args.prompt, args.max_tokens)
    with grpc.insecure_channel(args.gateway) as channel:
        try:
            token_ids, finished = generate(gateway_pb2_grpc.GatewayServiceStub(channel), request, timeout_s=120.0)
        except grpc.RpcError as error:
            code = error.code().name if isinstance(error, grpc.Call) else "UNKNOWN"
            print(f"error: {code}", file=sys.stderr)
            for field, description in field_violations(error):
                print(f"  {field}: {description}", file=sys.stderr)
            return 1
    reason = common_pb2.FinishReason.Name(finished.finish_reason)
    print(f"\n[{len(token_ids)} tokens, finish={reason}, prompt_tokens={finished.usage.prompt_tokens}]")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
