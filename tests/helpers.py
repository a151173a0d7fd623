"""Small helpers shared by the service tests."""

from __future__ import annotations

import asyncio

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from epd.server import CLIENT_OPTIONS
from epd.telemetry import scrape
from epd.v1 import gateway_pb2_grpc


def gateway_stub(address: str) -> gateway_pb2_grpc.GatewayServiceStub:
    return gateway_pb2_grpc.GatewayServiceStub(grpc.aio.insecure_channel(address, options=CLIENT_OPTIONS))


async def wait_for_metric(metrics_port: int, name: str, expected: float, timeout: float = 10.0) -> float:
    """Polls until a metric reaches ``expected`` (leases are freed by async notifications)."""
    deadline = asyncio.get_running_loop().time() + timeout
    value = scrape(metrics_port).get(name)
    while value != expected and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.1)
        value = scrape(metrics_port).get(name)
    return value


def violations(error: grpc.aio.AioRpcError) -> list[str]:
    """The field paths of a status's google.rpc.BadRequest details."""
    fields = []
    for detail in rpc_status.from_call(error).details:
        bad_request = error_details_pb2.BadRequest()
        if detail.Unpack(bad_request):
            fields += [v.field for v in bad_request.field_violations]
    return fields
