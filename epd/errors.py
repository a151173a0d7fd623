"""Domain errors and their gRPC status mapping, in one place.

Domain code raises these; servicers turn them into rich statuses (``google.rpc.Status`` with
``BadRequest`` or ``RetryInfo`` details) through :func:`to_rpc_status`. Anything else that
escapes a handler is a bug and becomes INTERNAL.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import grpc
from google.protobuf import duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2


@dataclass(frozen=True)
class FieldViolation:
    """One bad field, addressed like ``messages[0].parts[1].image.data``."""

    field: str
    description: str


class EpdError(Exception):
    """Base of all errors that map to a deliberate gRPC status."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidArgument(EpdError):
    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, message: str, violations: list[FieldViolation] | None = None):
        super().__init__(message)
        self.violations = violations or []

    @classmethod
    def for_field(cls, field: str, description: str) -> InvalidArgument:
        return cls(f"{field}: {description}", [FieldViolation(field, description)])


class FailedPrecondition(EpdError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class NotFound(EpdError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(EpdError):
    code = grpc.StatusCode.ALREADY_EXISTS


class Unimplemented(EpdError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(EpdError):
    """A bug or a broken invariant inside EPD or an engine; never the caller's fault."""

    code = grpc.StatusCode.INTERNAL


class DeadlineExceeded(EpdError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(EpdError):
    """A peer is down or this service is draining; the only code clients should retry."""

    code = grpc.StatusCode.UNAVAILABLE


class Aborted(EpdError):
    """The request lost a race it cannot win by waiting (a prefill's KV lease ran out before a
    decode took it): run again from the start, it may succeed. The gateway does so before the
    first token."""

    code = grpc.StatusCode.ABORTED


class ResourceExhausted(EpdError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


# Values libraries print into their messages: object reprs ("<PIL.Image.Image image mode=RGB
# size=10000x10 at 0x7f...>", "<class 'x.Y'>"), dumps of containers and arrays ("data={'images':
# [...]}", "array([...])", "tensor([...])"). They can run to megabytes, carry process memory
# addresses, and mean nothing to a client; each is cut out whole, brackets balanced.
_DUMP_START = re.compile(r"\s*(?:<[\w.]+ |\{'|\[<|\b(?:array|tensor)\()")
_OPENERS, _CLOSERS = "<{[(", ">}])"
# A status travels in HTTP/2 trailers, which peers cap (8 KiB by default in grpc-go and grpcio):
# bounded texts and a bounded number of field violations keep every status well inside that.
MESSAGE_BYTES = 400
DESCRIPTION_BYTES = 200
MAX_VIOLATIONS = 10
_CUT = "…"


def client_text(text: str, limit_bytes: int = MESSAGE_BYTES) -> str:
    """``text`` as a client may see it: every dump of a value cut out (a client sees the same
    words for the same mistake, and nothing of the process), at most ``limit_bytes`` of UTF-8."""
    kept, at = [], 0
    while (dump := _DUMP_START.search(text, at)) is not None:
        kept.append(text[at : dump.start()])
        at = _past_brackets(text, next(i for i in range(dump.start(), dump.end()) if text[i] in _OPENERS))
        kept.append(" " + _CUT if text[dump.start()].isspace() else _CUT)
    kept.append(text[at:])
    clean = "".join(kept)
    data = clean.encode()
    if len(data) <= limit_bytes:
        return clean
    return data[: limit_bytes - len(_CUT.encode())].decode(errors="ignore") + _CUT


def _past_brackets(text: str, opening: int) -> int:
    """The index just past the bracket that closes the one at ``opening`` (any kind counts, as
    reprs nest them freely), or the end of a dump that was itself cut short."""
    depth = 0
    for index in range(opening, len(text)):
        if text[index] in _OPENERS:
            depth += 1
        elif text[index] in _CLOSERS:
            depth -= 1
            if depth == 0:
                return index + 1
    return len(text)


def to_rpc_status(error: EpdError) -> status_pb2.Status:
    """Builds the rich status for an error: the code, the message and typed details.

    Every text passes :func:`client_text`, whichever library worded it, and at most
    ``MAX_VIOLATIONS`` fields are detailed (the message names how many there were)."""
    message = error.message
    if isinstance(error, InvalidArgument) and len(error.violations) > MAX_VIOLATIONS:
        message = f"{len(error.violations)} invalid fields, the first {MAX_VIOLATIONS} detailed: {message}"
    status = status_pb2.Status(code=error.code.value[0], message=client_text(message))
    if isinstance(error, InvalidArgument) and error.violations:
        detail = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=client_text(v.field, DESCRIPTION_BYTES), description=client_text(v.description, DESCRIPTION_BYTES))
                for v in error.violations[:MAX_VIOLATIONS]
            ]
        )
        status.details.add().Pack(detail)
    if isinstance(error, ResourceExhausted):
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(error.retry_after_s * 1e9))
        status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    return status


def internal_status(message: str) -> status_pb2.Status:
    return status_pb2.Status(code=code_pb2.INTERNAL, message=message)


# A stage's server and the gateway's client both time the same deadline; the server may cancel
# the stream (RST_STREAM, seen by the client as CANCELLED) a little before the client's timer.
_DEADLINE_SLACK_S = 0.25


def from_rpc_error(error: grpc.aio.AioRpcError, *, peer: str, deadline: float | None = None) -> EpdError:
    """Re-raises a downstream stage's failure as the matching domain error.

    Client mistakes keep their code and field details, so a caller sees exactly what the stage
    rejected; a stage that cannot be reached or crashed becomes UNAVAILABLE (retryable). A call
    CANCELLED as the request's ``deadline`` (``time.monotonic()``) ran out is DEADLINE_EXCEEDED:
    retrying it could not succeed.
    """
    from grpc_status import rpc_status

    code = error.code()
    message = f"{peer}: {error.details()}"
    if code == grpc.StatusCode.CANCELLED and deadline is not None and time.monotonic() >= deadline - _DEADLINE_SLACK_S:
        return DeadlineExceeded(f"{message} (the request's deadline ran out)")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        violations = []
        status = rpc_status.from_call(error)
        for detail in status.details if status else []:
            bad_request = error_details_pb2.BadRequest()
            if detail.Unpack(bad_request):
                violations += [FieldViolation(v.field, v.description) for v in bad_request.field_violations]
        return InvalidArgument(message, violations)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ResourceExhausted(message)
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return FailedPrecondition(message)
    if code == grpc.StatusCode.ABORTED:
        return Aborted(message)
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return Unimplemented(message)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(message)
    if code == grpc.StatusCode.INTERNAL:
        return Internal(message)  # a bug in the stage: retrying would not help
    return Unavailable(message)
