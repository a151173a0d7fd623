"""E/P/D across four hosts (issue 10, item 6): encoder, prefill, decode and gateway each in a
network namespace of its own, joined by veth pairs to a bridge, on addresses this test picks.
Loopback is private to each namespace, so every hop crosses the veths: gRPC, the embedding
READ (NIXL over UCX, held to TCP), and the KV pull (vLLM's NixlConnector and its side channel).
The tokens must equal the monolithic run's, which serves from this test's own namespace.
"""

from __future__ import annotations

import pytest

from epd.client import chat_request, generate
from epd.launcher import Stack, gateway_args
from epd.telemetry import scrape
from epd.testing import synthetic_image_png
from tests.helpers import gateway_stub
from tests.netns import Hosts, can_create_namespaces

_WHY_NOT = can_create_namespaces()
pytestmark = pytest.mark.skipif(_WHY_NOT is not None, reason=f"no network namespaces here: {_WHY_NOT}")
_HOSTS = ["encoder", "prefill", "decode", "gateway"]


async def test_epd_across_four_hosts_streams_the_monolithic_tokens(family_stack, tmp_path):
    model = family_stack.model
    requests = [chat_request([(synthetic_image_png(112 + 32 * i, 96, seed=950 + i), "image/png"), f"Host test {i}."], max_tokens=8, min_tokens=8) for i in range(2)]
    oracle = [(await generate(family_stack.gateway_stub("monolithic"), r, timeout=120)).token_ids for r in requests]
    with Hosts(_HOSTS) as hosts:
        stack = Stack(tmp_path)

        def start(name: str, args: list[str]):
            host = hosts.address[name]
            # UCX would otherwise use shared memory between processes of one machine.
            return stack.start(name, [*args, "--host", host, "--metrics-port", "0"], env={"UCX_TLS": "tcp"}, host=host, wrapper=hosts.wrapper(name))

        try:
            encoder = start("encoder", ["encoder", "--model", model])
            prefill = start("prefill", ["prefill", "--model", model])
            decode = start("decode", ["decode", "--model", model, "--mode", "decode"])
            stack.wait_ready([encoder, prefill, decode], timeout=600)
            gateway = start("gateway", gateway_args(model, "epd", encoders=[encoder.address], prefills=[prefill.address], decodes=[decode.address]))
            stack.wait_ready([gateway], timeout=300)
            stub = gateway_stub(gateway.address)
            for request, expected in zip(requests, oracle, strict=True):
                assert (await generate(stub, request, timeout=120)).token_ids == expected
            # The embeddings reached the prefill host by NIXL READ, not inline in a message.
            loaded = scrape(prefill.metrics_port, host=hosts.address["prefill"])
            assert loaded.get("epd_embedding_bytes_loaded{transport=nixl}", 0) > 0
            assert loaded.get("epd_embedding_bytes_loaded{transport=inline}", 0) == 0
        finally:
            stack.stop()
