"""Spreads calls over the instances of one stage: least in-flight first, round-robin on ties.

Channels are created once per address and reused; OpenTelemetry client interceptors carry the
W3C trace context to every stage.
"""

from __future__ import annotations

import contextlib
import functools
import itertools

import grpc

from epd.server import CLIENT_OPTIONS


class StagePool:
    """The instances of one stage (encoder, prefill or decode)."""

    def __init__(self, stage: str, addresses: list[str], stub_class, *, credentials: grpc.ChannelCredentials | None = None):
        from opentelemetry.instrumentation.grpc import aio_client_interceptors

        if not addresses:
            raise ValueError(f"no addresses for the {stage} stage")
        self.stage = stage
        # credentials from epd.security.channel_credentials (TLS/mTLS); None: plaintext.
        open_channel = grpc.aio.insecure_channel if credentials is None else functools.partial(grpc.aio.secure_channel, credentials=credentials)
        self._channels = {a: open_channel(a, options=CLIENT_OPTIONS, interceptors=aio_client_interceptors()) for a in addresses}
        self._stubs = {a: stub_class(channel) for a, channel in self._channels.items()}
        self._in_flight = dict.fromkeys(addresses, 0)
        self._turn = itertools.count()

    @property
    def addresses(self) -> list[str]:
        return list(self._stubs)

    def pick(self) -> str:
        """The least-loaded address; ties rotate so idle instances share the work."""
        start = next(self._turn)
        ordered = self.addresses[start % len(self._stubs) :] + self.addresses[: start % len(self._stubs)]
        return min(ordered, key=self._in_flight.__getitem__)

    def stub(self, address: str):
        return self._stubs[address]

    @contextlib.contextmanager
    def busy(self, address: str):
        """Counts a call against an instance while it runs."""
        self._in_flight[address] += 1
        try:
            yield self._stubs[address]
        finally:
            self._in_flight[address] -= 1

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
