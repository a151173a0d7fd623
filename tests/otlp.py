"""A minimal OTLP/gRPC trace receiver for tests: services export their spans here."""

from __future__ import annotations

import dataclasses
import threading
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclasses.dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self._server.start()

    def stop(self) -> None:
        self._server.stop(0)

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def Export(self, request, context):  # noqa: N802 - OTLP service method
        received = []
        for resource_spans in request.resource_spans:
            service = next((a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name"), "")
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(ReceivedSpan(service, span.name, span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex()))
        with self._lock:
            self._spans += received
        return trace_service_pb2.ExportTraceServiceResponse()
