"""Errors raised by the embedding transport; service code maps them onto gRPC status codes."""

from __future__ import annotations


class TransferError(Exception):
    """A fetch failed: the READ reported an error or timed out, the peer could not be reached,
    or a lease had expired (or was about to) before the READ started."""
