"""First-fit allocator of contiguous runs of fixed-size slots.

Both sides of the transport carve one registered buffer into equal units: the producer's arena
into slots, the consumer's receive buffer into pages. Neither is thread-safe; callers serialize.
"""

from __future__ import annotations

# The consumer's receive buffer is carved into pages of this size; the reader's prepared
# descriptor lists name the same pages.
PAGE_BYTES = 4096

_FREE = 0
_USED = 1


class SlotAllocator:
    """Tracks which of ``num_slots`` slots are in use and hands out contiguous runs.

    Occupancy lives in a ``bytearray`` (one byte per slot) so that finding a free run of ``k``
    slots is a single ``bytearray.find`` of ``k`` zero bytes, done in C.
    """

    def __init__(self, num_slots: int) -> None:
        """Creates an allocator with every slot free.

        Args:
            num_slots: Number of slots; must be positive.

        Raises:
            ValueError: If ``num_slots`` is not positive.
        """
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self._used = bytearray(num_slots)
        self._free = num_slots

    @property
    def num_slots(self) -> int:
        """Total number of slots."""
        return len(self._used)

    @property
    def free_slots(self) -> int:
        """Number of slots not currently allocated."""
        return self._free

    def alloc(self, count: int) -> int | None:
        """Allocates the first run of ``count`` contiguous free slots.

        Args:
            count: Run length; must be between 1 and ``num_slots``.

        Returns:
            Index of the first slot of the run, or None if no such run is free now.

        Raises:
            ValueError: If ``count`` is out of range.
        """
        if not 0 < count <= len(self._used):
            raise ValueError(f"count must be in [1, {len(self._used)}], got {count}")
        if count > self._free:
            return None
        start = self._used.find(bytes(count))  # bytes(count) is `count` zero (free) bytes
        if start < 0:
            return None
        self._used[start : start + count] = bytes([_USED]) * count
        self._free -= count
        return start

    def free(self, start: int, count: int) -> None:
        """Returns a run obtained from :meth:`alloc`.

        Args:
            start: First slot of the run.
            count: Run length passed to :meth:`alloc`.

        Raises:
            ValueError: If the range is out of bounds or contains a slot that is not allocated,
                which would otherwise corrupt the free count silently.
        """
        run = self._used[start : start + count]
        if start < 0 or count <= 0 or len(run) != count or _FREE in run:
            raise ValueError(f"slots [{start}, {start + count}) are not an allocated run")
        self._used[start : start + count] = bytes(count)
        self._free += count
