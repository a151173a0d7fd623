"""Stage routing: least in-flight first, ties rotate (pure logic; channels never connect)."""

from __future__ import annotations

from epd.v1 import encoder_pb2_grpc
from gateway.router import StagePool


async def test_least_in_flight_then_round_robin():
    pool = StagePool("encoder", ["a:1", "b:2", "c:3"], encoder_pb2_grpc.EncoderServiceStub)
    try:
        assert [pool.pick() for _ in range(3)] == ["a:1", "b:2", "c:3"]
        with pool.busy("a:1"), pool.busy("b:2"):
            assert {pool.pick() for _ in range(3)} == {"c:3"}
            with pool.busy("c:3"), pool.busy("c:3"):
                assert {pool.pick() for _ in range(4)} == {"a:1", "b:2"}
    finally:
        await pool.close()
