"""Stage routing (pure logic; channels never connect): least in-flight first, ties rotate,
instances known to serve first, down instances never, ones that failed a request last."""

from __future__ import annotations

import pytest

from epd.errors import Unavailable
from epd.v1 import encoder_pb2_grpc
from gateway.router import Health, RetryPolicy, StagePool


def _pool(addresses, on_change=None) -> StagePool:
    return StagePool("encoder", addresses, encoder_pb2_grpc.EncoderServiceStub, on_availability_change=on_change)


async def test_least_in_flight_then_round_robin():
    pool = _pool(["a:1", "b:2", "c:3"])
    try:
        assert [pool.pick() for _ in range(3)] == ["a:1", "b:2", "c:3"]
        with pool.busy("a:1"), pool.busy("b:2"):
            assert {pool.pick() for _ in range(3)} == {"c:3"}
            with pool.busy("c:3"), pool.busy("c:3"):
                assert {pool.pick() for _ in range(4)} == {"a:1", "b:2"}
    finally:
        await pool.close()


async def test_health_decides_who_is_picked():
    changes = []
    pool = _pool(["a:1", "b:2", "c:3"], on_change=lambda: changes.append(pool.available))
    try:
        pool._set_health("a:1", Health.SERVING)
        with pool.busy("a:1"), pool.busy("a:1"):
            # Known to serve beats not heard from, even when busier.
            assert {pool.pick() for _ in range(3)} == {"a:1"}
        pool._set_health("a:1", Health.DOWN)
        assert {pool.pick() for _ in range(4)} == {"b:2", "c:3"}
        # Instances that failed this request are avoided while others live...
        assert {pool.pick(frozenset({"b:2"})) for _ in range(3)} == {"c:3"}
        # ...and used as a last resort rather than failing the request.
        assert pool.pick(frozenset({"b:2", "c:3"})) in {"b:2", "c:3"}
        pool._set_health("b:2", Health.DOWN)
        assert changes == []
        pool._set_health("c:3", Health.DOWN)
        assert not pool.available and changes == [False]
        with pytest.raises(Unavailable, match="no live encoder instance"):
            pool.pick()
        pool._set_health("b:2", Health.SERVING)
        assert pool.available and changes == [False, True]
        assert pool.pick() == "b:2"
    finally:
        await pool.close()


def test_retry_backoff_is_jittered_and_doubles():
    policy = RetryPolicy(max_attempts=3, retry_backoff_s=0.1)
    for attempt in (1, 2, 3):
        delays = [policy.delay(attempt) for _ in range(200)]
        assert 0 <= min(delays) and max(delays) <= 0.1 * 2 ** (attempt - 1)
        assert max(delays) > 0.05 * 2 ** (attempt - 1)  # the range is used, not a constant
