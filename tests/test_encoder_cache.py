"""The encoder-output cache (issue 10, item 1): an item sent again, in a later request or in
concurrent ones, is encoded once; the arena serves the repeats (a request whose every item it
holds without an engine step, through the cache desk), or, once its encoder is gone, the shared
tier does, and the tokens stay those of monolithic vLLM.

The proof that the tower did not run is vLLM's own scheduling: ``epd_encoder_batch_items``
counts the items the encoder engine scheduled for its tower.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
import time

import pytest
import torch

from devkit.media import synthetic_image_png
from epd.client import chat_request, generate
from epd.telemetry import scrape
from tests.conftest import BF16, DEFAULT_FAMILY, stack_key
from tests.helpers import gateway_stub, wait_for_metric

_TOWER_RUNS = "epd_encoder_batch_items{modality=image}"
_HITS = "epd_encoder_cache_hits_total"
_MISSES = "epd_encoder_cache_misses_total"


def _request(seed: int, text: str):
    return chat_request([(synthetic_image_png(128, 96, seed=seed), "image/png"), text], max_tokens=6, min_tokens=6)


def _grown(before: dict[str, float], after: dict[str, float]) -> tuple[float, float, float]:
    return tuple(after.get(name, 0.0) - before.get(name, 0.0) for name in (_TOWER_RUNS, _HITS, _MISSES))


def _engine_requests(metrics: dict[str, float]) -> float:
    """Requests the encoder's vLLM engine finished, whatever their reason."""
    counts = [value for name, value in metrics.items() if name.startswith("vllm:request_success_total")]
    assert counts, "the encoder exports no vllm:request_success_total"
    return sum(counts)


# bf16 too: a cached fill is the tower's bf16 output, bit for bit, so tokens stay monolithic bf16's.
@pytest.mark.parametrize("family", [DEFAULT_FAMILY, stack_key("qwen2_5_omni", BF16)])
async def test_a_repeated_item_is_encoded_once_and_decodes_to_the_monolithic_tokens(family_stack, family):
    encoder, epd, monolithic = family_stack.encoder, family_stack.gateway_stub("epd"), family_stack.gateway_stub("monolithic")
    first, follow_up = _request(7301, "What is this?"), _request(7301, "And its colours?")
    oracle = [(await generate(monolithic, r, timeout=120)).token_ids for r in (first, follow_up)]

    before = scrape(encoder.metrics_port)
    assert (await generate(epd, first, timeout=120)).token_ids == oracle[0]
    assert _grown(before, scrape(encoder.metrics_port)) == (1, 0, 1)
    assert _engine_requests(scrape(encoder.metrics_port)) > _engine_requests(before)
    # The same image in the next turn, with other text: served from the arena, no tower run,
    # and not even an engine step: the cache desk leased the held output beside the engine.
    middle = scrape(encoder.metrics_port)
    assert (await generate(epd, follow_up, timeout=120)).token_ids == oracle[1]
    assert _grown(middle, scrape(encoder.metrics_port)) == (0, 1, 0)
    assert _engine_requests(scrape(encoder.metrics_port)) == _engine_requests(middle)
    # The follow-up's lease pins the entry (pinned bytes are not cache bytes) until the prefill,
    # which already holds the rows, releases it in the background.
    assert await wait_for_metric(encoder.metrics_port, "epd_arena_leases", 0.0) == 0.0
    assert scrape(encoder.metrics_port)["epd_encoder_cache_bytes"] > 0


async def test_concurrent_requests_for_a_new_item_run_the_tower_once(family_stack):
    encoder, epd, monolithic = family_stack.encoder, family_stack.gateway_stub("epd"), family_stack.gateway_stub("monolithic")
    requests = [_request(7302, f"Question {i}?") for i in range(3)]
    oracle = [(await generate(monolithic, r, timeout=120)).token_ids for r in requests]

    before = scrape(encoder.metrics_port)
    results = await asyncio.gather(*(generate(epd, r, timeout=120) for r in requests))
    assert [r.token_ids for r in results] == oracle
    assert _grown(before, scrape(encoder.metrics_port)) == (1, 2, 1)
    assert await wait_for_metric(encoder.metrics_port, "epd_arena_leases", 0.0) == 0.0


async def test_a_request_with_a_held_and_a_new_item_runs_the_engine_for_both_and_leaks_no_lease(family_stack):
    """The cache desk serves a request whole or not at all: the lease it took on the held item is
    given back, and the engine serves that item from the arena while its tower encodes the new one."""
    encoder, epd, monolithic = family_stack.encoder, family_stack.gateway_stub("epd"), family_stack.gateway_stub("monolithic")
    held, new = synthetic_image_png(128, 96, seed=7303), synthetic_image_png(96, 128, seed=7304)
    warm = _request(7303, "What is this?")
    both = chat_request([(held, "image/png"), (new, "image/png"), "Compare them."], max_tokens=6, min_tokens=6)
    oracle = (await generate(monolithic, both, timeout=120)).token_ids
    await generate(epd, warm, timeout=120)
    before = scrape(encoder.metrics_port)
    assert (await generate(epd, both, timeout=120)).token_ids == oracle
    after = scrape(encoder.metrics_port)
    assert _grown(before, after) == (1, 1, 1)
    assert _engine_requests(after) > _engine_requests(before)  # the desk declined it
    assert await wait_for_metric(encoder.metrics_port, "epd_arena_leases", 0.0) == 0.0


_SHARED_HITS = "epd_encoder_cache_shared_hits_total"
_SHARED_PUTS = "epd_encoder_cache_shared_puts_total"


async def test_an_item_whose_encoder_died_is_served_from_the_shared_tier_without_a_tower_run(family_stack):
    """The shared tier (issue 10, item 2): two encoders on one Mooncake Store node. The encoder
    that ran the tower for an item is killed; the next request for that item goes to the other
    encoder, which reads the output from the tier instead of encoding it, and the tokens stay
    those of monolithic vLLM."""
    from cli.launcher import gateway_args, shared_cache_flags

    s = family_stack
    first, follow_up = _request(7303, "What is this?"), _request(7303, "And its colours?")
    oracle = [(await generate(s.gateway_stub("monolithic"), r, timeout=120)).token_ids for r in (first, follow_up)]

    started = []

    def start(name, args):
        started.append(s.stack.start(name, args))
        return started[-1]

    try:
        tier = start("shared-cache", ["shared-cache"])
        await asyncio.to_thread(s.stack.wait_ready, [tier])
        encoders = [start(f"shared-encoder{i}", ["encoder", "--model", s.model, "--metrics-port", "0", *shared_cache_flags(tier)]) for i in range(2)]
        await asyncio.to_thread(s.stack.wait_ready, encoders, 600)
        gateway = start("gateway-shared", gateway_args(s.model, "epd-combined", encoders=[e.address for e in encoders], decodes=[s.combined.address]))
        await asyncio.to_thread(s.stack.wait_ready, [gateway])
        stub = gateway_stub(gateway.address)

        assert (await generate(stub, first, timeout=120)).token_ids == oracle[0]
        ran = [scrape(e.metrics_port).get(_TOWER_RUNS, 0.0) for e in encoders]
        assert sorted(ran) == [0.0, 1.0]
        owner, other = (encoders[0], encoders[1]) if ran[0] else (encoders[1], encoders[0])
        assert await wait_for_metric(owner.metrics_port, _SHARED_PUTS, 1.0) == 1.0

        owner.kill()  # the whole instance, engine included: its arena is gone
        before = scrape(other.metrics_port)
        assert (await generate(stub, follow_up, timeout=120)).token_ids == oracle[1]
        after = scrape(other.metrics_port)
        assert (after[_TOWER_RUNS] - before.get(_TOWER_RUNS, 0.0), after[_SHARED_HITS] - before.get(_SHARED_HITS, 0.0)) == (0, 1)
        assert after[_SHARED_PUTS] == before.get(_SHARED_PUTS, 0.0)  # a shared hit is not put back
        assert await wait_for_metric(other.metrics_port, "epd_arena_leases", 0.0) == 0.0
    finally:
        for service in reversed(started):
            await asyncio.to_thread(service.stop)
            s.stack.services.remove(service)


class _StalledStore:
    """A store client whose puts wait until ``go`` is set, and whose lookups take
    ``lookup_delay_s``: a shared tier that is slow or gone."""

    def __init__(self, store, go: threading.Event) -> None:
        self._store, self._go = store, go
        self.lookup_delay_s = 0.0

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    def put_from(self, key: str, address: int, nbytes: int) -> int:
        self._go.wait(30)
        return self._store.put_from(key, address, nbytes)

    def is_exist(self, key: str) -> int:
        time.sleep(self.lookup_delay_s)
        return self._store.is_exist(key)


def _offer_to_a_stalled_tier(master: str, metadata: str, results) -> None:
    """In a process of its own (the Mooncake client's threads stay out of pytest's): offers five
    4 KiB outputs to a tier whose puts stall, with room for three to wait; then looks one up
    while lookups are slow."""
    from epd.transport.shared_tier import SharedTier, SharedTierConfig

    size = 4096
    buffer = torch.arange(8 * size, dtype=torch.int64).to(torch.uint8)
    puts: list[int] = []
    tier = SharedTier(SharedTierConfig(master, metadata, "127.0.0.1"), buffer, "stall-test", lambda: puts.append(1), max_waiting_bytes=3 * size)
    go = threading.Event()
    tier._store = _StalledStore(tier._store, go)
    unpinned: list[int] = []
    for i in range(5):
        tier.offer(f"item{i}", i * size, size, lambda i=i: unpinned.append(i))
    at_once, waiting = list(unpinned), tier.waiting_bytes
    go.set()
    deadline = time.monotonic() + 30
    while len(unpinned) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    got = tier.get_into("item1", 6 * size, size) and torch.equal(buffer[6 * size : 7 * size], buffer[size : 2 * size])
    tier._store.lookup_delay_s = 0.8  # over the slow-lookup limit: found, then the tier is skipped
    slow = tier.get_into("item2", 6 * size, size)
    started = time.monotonic()
    skipped = not tier.get_into("item2", 6 * size, size) and time.monotonic() - started < 0.2
    tier.close()
    results.put((at_once, waiting, sorted(unpinned), tier.waiting_bytes, len(puts), got, slow, skipped))


def test_a_stalled_shared_tier_pins_bounded_bytes_and_slow_lookups_make_it_skipped(tmp_path):
    """Each output waiting to be put pins its fill, which cannot be evicted; with the tier slow
    or gone, the waiting bytes stay under their bound and the rest are not shared (unpinned at
    once), so the arena never fills with pins. Once puts go through, every pin ends. A lookup
    slower than the limit is answered, and the next one skips the tier instead of waiting."""
    from cli.launcher import Stack, shared_cache_flags

    stack = Stack(tmp_path)
    try:
        tier = stack.start("shared-cache", ["shared-cache"])
        stack.wait_ready([tier], 120)
        _, master, _, metadata = shared_cache_flags(tier)
        context = multiprocessing.get_context("spawn")
        results = context.Queue()
        child = context.Process(target=_offer_to_a_stalled_tier, args=(master, metadata, results), daemon=True)
        child.start()
        at_once, waiting, unpinned, left, puts, got, slow, skipped = results.get(timeout=120)
        child.join(30)
    finally:
        stack.stop()
    # item0 is in the stalled put and items 1 and 2 wait: 3 x 4 KiB, the bound.
    assert (at_once, waiting) == ([3, 4], 3 * 4096)
    assert (unpinned, left, puts, got) == ([0, 1, 2, 3, 4], 0, 3, True)
    # Lookups run on vLLM's scheduler thread: after a slow one the tier is skipped, not waited on.
    assert (slow, skipped) == (True, True)
