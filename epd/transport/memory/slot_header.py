"""The header in front of every published encoder output.

A consumer READs the header together with the rows, so it can check, after the READ and before
vLLM sees a byte, that it got what its handle promised: the producer finished writing
(``READY``), the slot still holds the same fill (its ``generation``; a slot that was freed and
refilled reads back a different one), the shape and dtype match, and the item is the one the
consumer will cache it as: the encoder names it (a digest of its content hash). Without these,
a late READ of a reused slot would silently return another item's embedding, and a caller could
hand a consumer its own genuine handle under another image's content hash, which vLLM's
encoder cache would then serve to every later request for that image.

Layout (little-endian, 64 bytes so the rows that follow stay 64-byte aligned)::

    magic "EPDE" | version u8 | status u8 | dtype u8 | pad u8 | generation u64 | rows u32 | width u32
    | item: SHA-256 of the item's key (its content hash), 32 bytes | pad
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import struct

import torch

HEADER_BYTES = 64
_MAGIC = b"EPDE"
_VERSION = 2  # 2: the item's name
_STRUCT = struct.Struct("<4sBBBxQII32s")

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_DTYPE_CODES = {"float32": 1, "float16": 2, "bfloat16": 3}
_DTYPE_NAMES = {code: name for name, code in _DTYPE_CODES.items()}


class SlotStatus(enum.IntEnum):
    PENDING = 0  # reserved; the producer has not written the rows yet
    READY = 1
    FAILED = 2  # the producer could not write it (its output did not match the reservation)


@dataclasses.dataclass(frozen=True)
class SlotHeader:
    status: SlotStatus
    dtype: str  # a key of DTYPES
    generation: int
    rows: int
    width: int
    item: bytes  # item_digest() of the item's key

    def pack_into(self, buffer: torch.Tensor, offset: int) -> None:
        """Writes the header at ``offset`` of a uint8 tensor."""
        packed = _STRUCT.pack(_MAGIC, _VERSION, int(self.status), _DTYPE_CODES[self.dtype], self.generation, self.rows, self.width, self.item)
        buffer[offset : offset + len(packed)].copy_(torch.frombuffer(bytearray(packed), dtype=torch.uint8))

    @classmethod
    def unpack_from(cls, buffer: torch.Tensor, offset: int) -> SlotHeader:
        """Reads a header; raises ValueError if the bytes are not one."""
        raw = bytes(buffer[offset : offset + _STRUCT.size].numpy())
        magic, version, status, dtype_code, generation, rows, width, item = _STRUCT.unpack(raw)
        if magic != _MAGIC or version != _VERSION or dtype_code not in _DTYPE_NAMES or status not in SlotStatus._value2member_map_:
            raise ValueError("not an EPD slot header (magic, version, dtype or status unknown)")
        return cls(SlotStatus(status), _DTYPE_NAMES[dtype_code], generation, rows, width, item)

    def names(self, key: str) -> bool:
        """Whether this slot holds the item called ``key``."""
        return self.item == item_digest(key)


def item_digest(key: str) -> bytes:
    """How a slot header names its item (vLLM's identifier of it: the item's content hash)."""
    return hashlib.sha256(key.encode()).digest()


def header_fields(view: memoryview, offset: int) -> tuple:
    """The raw header at ``offset`` of a buffer's memoryview, for a fast comparison with
    :func:`ready_fields` (a read is checked before every use)."""
    return _STRUCT.unpack_from(view, offset)


def ready_fields(dtype: str, generation: int, rows: int, width: int, key: str) -> tuple:
    """What :func:`header_fields` reads back from a fully written slot of this lease that holds
    the item called ``key``."""
    return (_MAGIC, _VERSION, int(SlotStatus.READY), _DTYPE_CODES[dtype], generation, rows, width, item_digest(key))


def slot_bytes(rows: int, width: int, dtype: str) -> int:
    """Header plus rows: what one published item occupies."""
    return HEADER_BYTES + rows * width * DTYPES[dtype].itemsize


def dtype_name(dtype: torch.dtype) -> str:
    """The header's name for a torch dtype; raises KeyError for one it cannot carry."""
    return {v: k for k, v in DTYPES.items()}[dtype]
