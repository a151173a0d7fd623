"""Request work sized by its input: small work runs on the event loop, large work in a thread.

Handing a call to a worker thread and back costs two thread switches and a wake-up of the
event loop, and the worker then holds the GIL the loop needs: on a 2-core host that is more
than parsing, hashing or rendering a typical request takes (``python -m bench --only
gateway_overhead`` counts it; in the gateway under ``python -m bench --only serving``, parsing
a 0.76 MB request took 1.6 ms through a thread and 1.2 ms in place, medians). Up to the bounds
below the work stays under a millisecond (measured here: rendering 1 KiB of chat text 0.4 ms,
parsing a request of 1 MiB, which hashes its media with SHA-256, 0.6 ms), so it runs in place;
anything larger goes to a thread, so a request of megabytes never holds up the loop other
streams share.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

INLINE_TEXT_BYTES = 1024  # chat text to render (tokenizing is the cost)
INLINE_MESSAGE_BYTES = 1024 * 1024  # a serialized request to parse (hashing its media is the cost)

_T = TypeVar("_T")


async def run_sized(size: int, inline_limit: int, fn: Callable[..., _T], /, *args) -> _T:
    """``fn(*args)``: in place when ``size`` is at most ``inline_limit``, else in a worker thread."""
    if size <= inline_limit:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)
