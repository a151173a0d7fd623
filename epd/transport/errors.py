"""Errors raised by the embedding transport; service code maps them onto gRPC status codes."""

from __future__ import annotations


class ArenaFullError(Exception):
    """The arena has no free run of slots large enough right now.

    Attributes:
        retry_after_s: Suggested wait before retrying. A hint only: leases usually end within
            milliseconds, when their consumer's READ notification arrives.
    """

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class TransferError(Exception):
    """A fetch failed: the READ reported an error or timed out, the peer could not be reached,
    or a lease had expired (or was about to) before the READ started."""
