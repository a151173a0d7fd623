"""Leases granted to a caller that may be gone: the one place that matches a caller giving up
with the leases it was granted, whichever comes first.

A caller can give up on a request (cancelled, past its deadline) just as the leases it asked for
are granted: the output is then on its way to nobody, and its leases would wait for their TTL.
Both sides note what they know here, and whichever comes second frees the leases.
"""

from __future__ import annotations

import operator
import threading
from collections import OrderedDict
from collections.abc import Callable

# Entries kept on each side, the oldest dropped first. A caller gives up within moments of its
# call, so this caps memory; only a caller that gives up after this many later grants finds its
# entry gone, and its leases then end by their TTL, as without the ledger.
_ENTRIES_KEPT = 1024


class ClaimLedger:
    """Thread-safe: callers give up on one thread while leases are granted on another.

    ``matches(granted_key, given_up_key)``: whether the two name the same request (equality,
    unless the granting side knows requests by ids of its own).
    """

    def __init__(self, matches: Callable[[str, str], bool] = operator.eq) -> None:
        self._matches = matches
        self._granted: OrderedDict[str, list[str]] = OrderedDict()  # key -> the leases granted under it
        self._given_up: OrderedDict[str, None] = OrderedDict()  # keys given up on before any grant
        self._lock = threading.Lock()

    def granted(self, key: str, lease_ids: list[str]) -> bool:
        """Records the leases granted under ``key``; False when its caller has given up
        already: nobody will claim them, free them now."""
        with self._lock:
            for given_up in self._given_up:
                if self._matches(key, given_up):
                    del self._given_up[given_up]
                    return False
            self._granted[key] = lease_ids
            _trim(self._granted)
            return True

    def give_up(self, key: str) -> list[str]:
        """The leases granted under ``key``, to free; none while nothing has been granted yet
        (:meth:`granted` then refuses the grant) or ever will be."""
        with self._lock:
            for granted in reversed(self._granted):
                if self._matches(granted, key):
                    return self._granted.pop(granted)
            self._given_up[key] = None
            _trim(self._given_up)
            return []


def _trim(entries: OrderedDict) -> None:
    while len(entries) > _ENTRIES_KEPT:
        entries.popitem(last=False)
