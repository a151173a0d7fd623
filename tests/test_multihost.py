"""E/P/D across hosts (issue 10, items 4 and 6): encoder, prefill, decode and gateway each in a
network namespace of its own, joined by veth pairs to a bridge, on addresses this test picks.
Loopback is private to each namespace, so every hop crosses the veths: gRPC, the embedding
READ (NIXL over UCX, held to TCP), and the KV pull (vLLM's NixlConnector and its side channel).
The tokens must equal the monolithic run's, which serves from this test's own namespace.

The gateway finds its encoders by a DNS name (its host's own /etc/hosts, edited while it runs):
a second encoder host is added to the name under load and takes work, then is taken off the
name and killed, and no request fails.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from cli.launcher import Stack, gateway_args
from devkit.media import synthetic_image_png
from epd.client import chat_request, generate
from epd.telemetry import scrape
from gateway.router import HashRing
from tests.helpers import SMALL_KV_CACHE, affinity_key_flags, gateway_stub, image_affinity_key
from tests.netns import Hosts, can_create_namespaces

_WHY_NOT = can_create_namespaces()
pytestmark = pytest.mark.skipif(_WHY_NOT is not None, reason=f"no network namespaces here: {_WHY_NOT}")
_HOSTS = ["encoder", "encoder2", "prefill", "decode", "gateway"]
_ENCODERS = "encoders.epd.test"  # the name the gateway resolves, on its host only
_PER_ENCODER = 3  # images whose affinity key the ring gives to each encoder
_LOAD_REQUESTS = 600  # at most, two at a time (a bound: the phases below stop the load, at about 3 per second)
_PHASE_TIMEOUT_S = 90.0


def _images_for(addresses: list[str], secret: bytes) -> list[bytes]:
    """Images alternating between the encoders their affinity key points to on the ring, so
    each encoder owns some of the load's keys (which ones depends on the addresses)."""
    ring, owned = HashRing(addresses, secret), {a: [] for a in addresses}
    for seed in range(950, 1150):
        image = synthetic_image_png(96 + 16 * (seed % 4), 96, seed=seed)
        owner = owned[ring.walk(image_affinity_key(image))[0]]
        if len(owner) < _PER_ENCODER:
            owner.append(image)
    return [image for pair in zip(*owned.values(), strict=True) for image in pair]


def _request(images: list[bytes], index: int):
    return chat_request([(images[index % len(images)], "image/png"), f"Host test {index % len(images)}."], max_tokens=6, min_tokens=6)


async def _until(condition, timeout: float = _PHASE_TIMEOUT_S) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.25)
    return condition()


async def test_epd_across_hosts_streams_the_monolithic_tokens_while_encoders_come_and_go(family_stack, tmp_path):
    model = family_stack.model
    with Hosts(_HOSTS) as hosts:
        stack = Stack(tmp_path)

        def start(name: str, args: list[str]):
            host = hosts.address[name]
            # UCX_TLS: UCX would otherwise use shared memory between processes of one machine.
            # UCX_NET_DEVICES: set for the host's veth, because this test process may carry "lo"
            # already (an in-process NIXL agent of an earlier test set it), which every service
            # started from here would inherit: its UCX would then publish loopback addresses that
            # no other host can reach ("Destination is unreachable").
            env = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": hosts.device[name]}
            return stack.start(name, [*args, "--host", host, "--metrics-port", "0"], env=env, host=host, wrapper=hosts.wrapper(name))

        def items_encoded(encoder) -> float:
            return scrape(encoder.metrics_port, host=encoder.host).get("epd_encoder_items_total", 0.0)

        try:
            # Each host has ports of its own, so the test can name them and start every service
            # at once; instances of one Service share a port, as pods do.
            port = {"encoder": 50051, "encoder2": 50051, "prefill": 50052, "decode": 50053}
            at = {name: f"{hosts.address[name]}:{number}" for name, number in port.items()}
            hosts.set_names("gateway", {_ENCODERS: [hosts.address["encoder"]]})
            encoder = start("encoder", ["encoder", "--model", model, "--port", str(port["encoder"])])
            encoder2 = start("encoder2", ["encoder", "--model", model, "--port", str(port["encoder2"])])
            prefill = start("prefill", ["prefill", "--model", model, "--port", str(port["prefill"]), *SMALL_KV_CACHE])
            decode = start("decode", ["decode", "--model", model, "--mode", "decode", "--port", str(port["decode"]), *SMALL_KV_CACHE])
            encoders = f"dns:///{_ENCODERS}:{port['encoder']}"
            keyed, secret = affinity_key_flags(tmp_path)
            gateway = start("gateway", gateway_args(model, "epd", encoders=[encoders], prefills=[at["prefill"]], decodes=[at["decode"]], extra=keyed))
            images = _images_for([at["encoder"], at["encoder2"]], secret)
            monolithic = family_stack.gateway_stub("monolithic")
            oracle = [(await generate(monolithic, _request(images, i), timeout=120)).token_ids for i in range(len(images))]
            stack.wait_ready([encoder, encoder2, prefill, decode, gateway], timeout=600)
            stub = gateway_stub(gateway.address)
            for index in range(2):
                assert (await generate(stub, _request(images, index), timeout=120)).token_ids == oracle[index]
            # The embeddings reached the prefill host by NIXL READ, not inline in a message.
            loaded = scrape(prefill.metrics_port, host=prefill.host)
            assert loaded.get("epd_embedding_bytes_loaded{transport=nixl}", 0) > 0
            assert loaded.get("epd_embedding_bytes_loaded{transport=inline}", 0) == 0

            outcomes: list = []
            sent = iter(range(_LOAD_REQUESTS))
            stop = asyncio.Event()

            async def client() -> None:
                while not stop.is_set() and (index := next(sent, None)) is not None:
                    try:
                        outcomes.append((index, (await generate(stub, _request(images, index), timeout=120)).token_ids))
                    except Exception as exc:  # noqa: BLE001 - every failure is reported below
                        outcomes.append((index, exc))

            load = asyncio.gather(client(), client())
            try:
                # Scaled up: the name lists a second host, which starts taking items.
                hosts.set_names("gateway", {_ENCODERS: [encoder.host, encoder2.host]})
                assert await _until(lambda: items_encoded(encoder2) > 0), "the added encoder took no work"
                # Scaled down: off the name, then gone; nothing was in flight on it by then.
                hosts.set_names("gateway", {_ENCODERS: [encoder.host]})
                await asyncio.sleep(6.0)  # a resolve period (5 s) and the calls it had
                taken = items_encoded(encoder2)
                encoder2.kill()
                served = len(outcomes)
                assert await _until(lambda: len(outcomes) >= served + 6), "no requests served after the encoder left"
            finally:
                stop.set()
                await load
            failures = [(i, o) for i, o in outcomes if isinstance(o, Exception)]
            assert not failures, failures[:3]
            assert all(tokens == oracle[i % len(images)] for i, tokens in outcomes)
            assert 0 < taken < len(outcomes)
        finally:
            stack.stop()
