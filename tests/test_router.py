"""Stage routing (pure logic; channels never connect): least in-flight first, ties rotate,
instances known to serve first, down instances never, ones that failed a request last; keyed
work by consistent hashing with bounded load; a request retried when its KV lease ran out."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from epd import wire
from epd.client import chat_request
from epd.domain import FinishReason, KvHandoff
from epd.errors import Aborted, Unavailable
from epd.media import MediaLimits
from epd.v1 import encoder_pb2_grpc
from gateway.pipeline import Delta, DisaggregatedPipeline, Mode
from gateway.router import HashRing, Health, RetryPolicy, StagePool, read_routing_secret
from gateway.stages import DecodeEnd, DecodeStep, Prefilled, StageFailed


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


_KEYS = [f"item-{i}" for i in range(300)]


async def test_a_key_sticks_to_one_instance_and_keys_spread_evenly():
    pool = _pool(["a:1", "b:2", "c:3"])
    try:
        owners = {key: pool.pick_for_key(key) for key in _KEYS}
        assert all(pool.pick_for_key(key) == owner for key, owner in owners.items())
        shares = [list(owners.values()).count(a) / len(_KEYS) for a in pool.addresses]
        assert all(0.2 < share < 0.47 for share in shares), shares
    finally:
        await pool.close()


async def test_an_instance_leaving_or_joining_moves_only_its_own_keys():
    pool = _pool(["a:1", "b:2", "c:3"])
    try:
        owners = {key: pool.pick_for_key(key) for key in _KEYS}
        pool._set_health("b:2", Health.DOWN)
        moved = {key: pool.pick_for_key(key) for key in _KEYS}
        assert all(moved[key] == owner for key, owner in owners.items() if owner != "b:2")
        assert "b:2" not in moved.values()
        pool._set_health("b:2", Health.UNKNOWN)  # back (restarted at the same address)
        assert {key: pool.pick_for_key(key) for key in _KEYS} == owners
    finally:
        await pool.close()


async def test_a_hot_key_spills_to_the_next_instance_on_the_ring():
    pool = _pool(["a:1", "b:2", "c:3"])
    try:
        key = _KEYS[0]
        ring_order = pool._ring.walk(key)
        assert pool.pick_for_key(key) == ring_order[0]
        with pool.busy(ring_order[0]), pool.busy(ring_order[0]):
            # Two in flight against a bound of ceil(1.25 * 3 / 3) = 2: the owner is full.
            assert pool.pick_for_key(key) == ring_order[1]
            with pool.busy(ring_order[1]), pool.busy(ring_order[1]), pool.busy(ring_order[2]):
                assert pool.pick_for_key(key) == ring_order[0]  # the bound grew with the load
        # An instance that failed this request is passed over, in ring order too.
        assert pool.pick_for_key(key, frozenset({ring_order[0]})) == ring_order[1]
    finally:
        await pool.close()


async def test_a_key_goes_back_to_the_instance_that_served_it_past_the_load_bound():
    """An encoder answers an item its arena holds without its engine (the cache desk), so a
    busy holder costs the key nothing, where another instance would run the tower again."""
    pool = _pool(["a:1", "b:2", "c:3"])
    try:
        key = _KEYS[0]
        ring_order = pool._ring.walk(key)
        with pool.busy(ring_order[0]), pool.busy(ring_order[0]):
            spilled = pool.pick_for_key(key)
        assert spilled == ring_order[1]
        pool.record_holder(key, spilled)
        assert pool.pick_for_key(key) == spilled  # not back to the (now idle) ring owner
        with pool.busy(spilled), pool.busy(spilled), pool.busy(spilled):
            assert pool.pick_for_key(key) == spilled  # far past the bound of 2
        # A holder that failed this request, is down, or has left is passed over.
        assert pool.pick_for_key(key, frozenset({spilled})) == ring_order[0]
        pool._set_health(spilled, Health.DOWN)
        assert pool.pick_for_key(key) == ring_order[0]
    finally:
        await pool.close()


async def test_a_joining_instance_takes_the_held_keys_whose_ring_point_it_now_owns():
    """Holders keep the keys that spilled to them, not the keys a newcomer owns on the ring:
    joining instances take their share of keys, and only that share."""
    pool = _pool(["a:1", "b:2"])
    try:
        for address in pool.addresses:
            pool._set_health(address, Health.SERVING)
        for key in _KEYS:
            pool.record_holder(key, pool.pick_for_key(key))
        before = {key: pool.pick_for_key(key) for key in _KEYS}
        pool._set_members(["a:1", "b:2", "c:3"])
        pool._set_health("c:3", Health.SERVING)
        after = {key: pool.pick_for_key(key) for key in _KEYS}
        moved = {key for key in _KEYS if after[key] != before[key]}
        assert moved and all(after[key] == "c:3" for key in moved)
        assert moved == {key for key in _KEYS if pool._ring.walk(key)[0] == "c:3"}
    finally:
        await pool.close()


def test_the_routing_secret_decides_where_keys_land(tmp_path):
    """Replicas that share the key file place every key alike; without it (or with another) the
    placement is a different one, which a client cannot compute."""
    addresses = ["a:1", "b:2", "c:3"]
    keys = [f"item {i}" for i in range(300)]
    (tmp_path / "one").write_text("shared secret\n")
    (tmp_path / "same").write_text("  shared secret")
    (tmp_path / "other").write_text("another secret")

    def owners(secret: bytes) -> list[str]:
        ring = HashRing(addresses, secret)
        return [ring.walk(key)[0] for key in keys]

    shared = owners(read_routing_secret(str(tmp_path / "one")))
    assert shared == owners(read_routing_secret(str(tmp_path / "same")))  # surrounding whitespace ignored
    assert len(read_routing_secret()) == 32 and read_routing_secret() != read_routing_secret()  # a process's own: random
    for secret in (read_routing_secret(str(tmp_path / "other")), read_routing_secret()):
        moved = sum(a != b for a, b in zip(shared, owners(secret), strict=True))
        assert moved > len(keys) // 3  # about 2/3 of the keys land elsewhere under another secret
    (tmp_path / "blank").write_text(" \n")
    with pytest.raises(ValueError, match="is empty"):
        read_routing_secret(str(tmp_path / "blank"))
    with pytest.raises(ValueError, match="cannot read the affinity key file"):
        read_routing_secret(str(tmp_path / "missing"))


async def test_without_affinity_keys_are_ignored():
    pool = StagePool("encoder", ["a:1", "b:2"], encoder_pb2_grpc.EncoderServiceStub, affinity=False)
    try:
        assert [pool.pick_for_key("same") for _ in range(4)] == ["a:1", "b:2", "a:1", "b:2"]
    finally:
        await pool.close()


async def _until(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return condition()


def _fake_dns(monkeypatch, answers: dict[str, list[str]]) -> None:
    """``socket.getaddrinfo`` answers from ``answers`` (edited by the test as it goes)."""

    def resolve(host, port, *args, **kwargs):
        if host not in answers:
            raise socket.gaierror(socket.EAI_NONAME, "unknown name")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in answers[host]]

    monkeypatch.setattr(socket, "getaddrinfo", resolve)


async def test_a_dns_name_stands_for_the_instances_it_resolves_to(monkeypatch):
    """Membership follows the name's answers (a fake resolver; the instances are loopback
    addresses nobody listens on, so their health watches fail and nothing else is reached)."""
    answers = {"encoders.test": ["127.0.0.2"]}
    _fake_dns(monkeypatch, answers)
    pool = StagePool("encoder", ["dns:///encoders.test:50999", "127.0.0.1:1"], encoder_pb2_grpc.EncoderServiceStub, resolve_interval_s=0.05)
    try:
        assert pool.addresses == ["127.0.0.1:1", "127.0.0.2:50999"]  # resolved before the first pick
        pool.watch_health()
        answers["encoders.test"] = ["127.0.0.2", "127.0.0.3"]  # scaled up
        assert await _until(lambda: "127.0.0.3:50999" in pool.addresses)
        with pool.busy("127.0.0.2:50999"):
            answers["encoders.test"] = ["127.0.0.3"]  # scaled down while a call runs there
            assert await _until(lambda: "127.0.0.2:50999" not in pool.addresses)
            assert pool.stub("127.0.0.2:50999") is not None  # its call keeps the channel
        with pytest.raises(Unavailable, match="no longer an instance"):
            pool.stub("127.0.0.2:50999")
        assert set(pool._ring.walk("any key")) == {"127.0.0.1:1", "127.0.0.3:50999"}  # the ring follows
        del answers["encoders.test"]  # a DNS failure keeps the last answer
        await asyncio.sleep(0.2)
        assert pool.addresses == ["127.0.0.1:1", "127.0.0.3:50999"]
    finally:
        await pool.close()


async def test_an_instance_listed_again_while_a_call_runs_is_watched_again(monkeypatch):
    """A pod that drops out of DNS for a moment while a call to it runs, then comes back, is a
    member with a health watch again (leaving stopped its watch), and a call to an instance that
    has left since it was picked is UNAVAILABLE, which is retried."""
    answers = {"encoders.test": ["127.0.0.2"]}
    _fake_dns(monkeypatch, answers)
    address = "127.0.0.2:50999"
    pool = StagePool("encoder", ["dns:///encoders.test:50999"], encoder_pb2_grpc.EncoderServiceStub, resolve_interval_s=0.05)
    try:
        pool.watch_health()
        with pool.busy(address):
            answers["encoders.test"] = ["127.0.0.3"]
            assert await _until(lambda: address not in pool.addresses)
            assert address not in pool._watchers
            answers["encoders.test"] = ["127.0.0.2", "127.0.0.3"]
            assert await _until(lambda: address in pool.addresses)
        assert pool.stub(address) is not None  # the call's end did not drop it
        watcher = pool._watchers.get(address)
        assert watcher is not None and not watcher.done()
        answers["encoders.test"] = ["127.0.0.3"]
        assert await _until(lambda: address not in pool.addresses)
        with pytest.raises(Unavailable, match="no longer an instance"), pool.busy(address):
            pass
    finally:
        await pool.close()


def test_retry_backoff_is_jittered_and_doubles():
    policy = RetryPolicy(max_attempts=3, retry_backoff_s=0.1)
    for attempt in (1, 2, 3):
        delays = [policy.delay(attempt) for _ in range(200)]
        assert 0 <= min(delays) and max(delays) <= 0.1 * 2 ** (attempt - 1)
        assert max(delays) > 0.05 * 2 ** (attempt - 1)  # the range is used, not a constant


async def test_releasing_leases_on_an_encoder_that_left_is_logged_not_raised(caplog):
    """The gateway frees a failed attempt's leases in a ``finally``: an encoder that has left
    the pool since (scaled away) must not replace the request's own error with another."""
    from gateway.stages import EncoderClient, Leases

    pool = _pool(["127.0.0.1:1"])
    leases = Leases()
    leases.new_key("127.0.0.9:50051")
    try:
        await EncoderClient(pool).release(leases)
    finally:
        await pool.close()
    assert "could not release the leases of 1 calls on 127.0.0.9:50051" in caplog.text


class _FirstDecodeFails:
    """Stand-in stage clients (pure orchestration; no channel): each prefill's first token is 4
    plus its number; the first decode fails before answering with ``error``; the rest answer."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.prefills: list[frozenset[str]] = []  # what each prefill call was told to avoid
        self.continued: tuple[int, ...] = ()  # the last prefill's continuation
        self.released: list[KvHandoff] = []
        self.pool = self

    async def close(self) -> None:
        pass

    async def prefill(self, request, deadline, avoid) -> Prefilled:
        assert request.chat and not request.prompt_token_ids  # the prefill renders the chat
        self.prefills.append(avoid)
        self.continued = request.continuation
        number = len(self.prefills)
        handoff = KvHandoff(f"prefill-{number}", ((1,),), "127.0.0.1", 5600, "r", 3, 1)
        return Prefilled(4 + number, "x", None, handoff, (1, 2, 3), 3, f"prefill-{number}:1")

    async def decode(self, request, deadline, avoid):
        assert request.prompt_token_ids == (1, 2, 3) and not request.chat  # the ids the prefill rendered
        assert request.continuation == (*self.continued, 4 + len(self.prefills))  # then the reply so far and that prefill's first token
        if request.kv_handoff.remote_engine_id == "prefill-1":
            raise self.error
        yield DecodeStep([7, 8], "ab", 3)
        yield DecodeEnd(FinishReason.LENGTH, 3)

    async def release_kv(self, request_id, handoff, avoid) -> None:
        self.released.append(handoff)

    async def release(self, leases) -> None:
        pass  # a text-only request holds no embedding leases


async def _run_once(stages: _FirstDecodeFails) -> list:
    pipeline = DisaggregatedPipeline(Mode.EPD, MediaLimits(), stages, stages, stages, retry=RetryPolicy(max_attempts=2, retry_backoff_s=0.001))
    request = wire.generate_request_from_wire(chat_request(["hello"], max_tokens=4))
    return [event async for event in pipeline.generate(request, deadline=None)]


async def test_a_kv_lease_that_ran_out_is_prefilled_again_and_released():
    stages = _FirstDecodeFails(Aborted("kv_handoff: the KV is freed -1.0 s from now; run it again"))
    events = await _run_once(stages)
    assert [e.token_ids for e in events if isinstance(e, Delta)] == [[5], [6], [7, 8]]  # resumed after the first prefill's token
    assert stages.prefills == [frozenset(), frozenset()]  # an expired lease is nobody's fault: nothing avoided
    assert [h.remote_engine_id for h in stages.released] == ["prefill-1"]  # the first try's KV, not waiting for its lease


async def test_a_decode_failing_before_it_answers_sends_the_next_try_to_another_prefill_too():
    """It most often failed to pull the KV because the prefill holding it died (a kill test once
    spent its last try on that dead prefill, which the gateway had not noticed yet)."""
    stages = _FirstDecodeFails(StageFailed("decode", "decode-a:1", "engine failed request r-decode (finish reason 'error')"))
    events = await _run_once(stages)
    assert [e.token_ids for e in events if isinstance(e, Delta)] == [[5], [6], [7, 8]]  # resumed after the first prefill's token
    assert stages.prefills == [frozenset(), frozenset({"decode-a:1", "prefill-1:1"})]
