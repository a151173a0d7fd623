"""What a consumer needs to READ a producer's arena (:class:`TransferCredentials`): written by
the encoder's engine for the encoder service beside it, handed to consumers only over gRPC
(``EncoderService.GetTransferMetadata``)."""

from __future__ import annotations

import dataclasses
import struct
from typing import TYPE_CHECKING

import torch

from epd.transport.memory.shared_buffer import SharedBuffer

if TYPE_CHECKING:
    from epd.v1 import encoder_pb2

_CREDENTIALS_FORMAT = struct.Struct("<4sBIII")  # magic, version, then the three field lengths
_CREDENTIALS_ARENA = struct.Struct("<QQQ")  # then the arena's address, bytes and unit
_CREDENTIALS_VERSION = 2
_CREDENTIALS_MAGIC = b"EPDT"


@dataclasses.dataclass(frozen=True)
class TransferCredentials:
    """What a consumer needs to READ a producer's arena: secrets, handed out only over gRPC.

    The arena fields (as in ``GetTransferMetadataResponse``) let a consumer prepare the arena's
    descriptors once; all 0 when the producer does not say.
    """

    agent_name: str
    agent_metadata: bytes
    location_key: bytes
    arena_address: int = 0  # of the first slot, in the producer's process
    arena_bytes: int = 0  # a whole number of units
    arena_unit_bytes: int = 0  # the slot size: items start on a unit boundary and own whole units

    def save(self, buffer_name: str) -> SharedBuffer:
        """Writes them to a ``0600`` shared-memory file for the encoder service next to the
        engine (which serves ``GetTransferMetadata``); keep the buffer and close it at shutdown."""
        name = self.agent_name.encode()
        blob = _CREDENTIALS_FORMAT.pack(_CREDENTIALS_MAGIC, _CREDENTIALS_VERSION, len(name), len(self.agent_metadata), len(self.location_key))
        blob += _CREDENTIALS_ARENA.pack(self.arena_address, self.arena_bytes, self.arena_unit_bytes)
        blob += name + self.agent_metadata + self.location_key
        buffer = SharedBuffer.create(buffer_name, len(blob))
        buffer.tensor.copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
        return buffer

    @classmethod
    def load(cls, buffer_name: str) -> TransferCredentials:
        """Reads what :meth:`save` wrote.

        Raises:
            FileNotFoundError: the producer has not written them (inline transport, or not started).
            ValueError: the file holds something else.
        """
        raw = bytes(SharedBuffer.attach(buffer_name).tensor.numpy())
        magic, version, name_len, metadata_len, key_len = _CREDENTIALS_FORMAT.unpack_from(raw)
        # The engine that writes the file and the service that reads it are one deployment.
        header_len = _CREDENTIALS_FORMAT.size + _CREDENTIALS_ARENA.size
        if magic != _CREDENTIALS_MAGIC or version != _CREDENTIALS_VERSION or len(raw) != header_len + name_len + metadata_len + key_len:
            raise ValueError(f"shared buffer {buffer_name!r} holds no EPD transfer credentials")
        arena = _CREDENTIALS_ARENA.unpack_from(raw, _CREDENTIALS_FORMAT.size)
        body = raw[header_len:]
        return cls(body[:name_len].decode(), body[name_len : name_len + metadata_len], body[name_len + metadata_len :], *arena)

    def to_wire(self) -> encoder_pb2.GetTransferMetadataResponse:
        """The ``GetTransferMetadata`` answer that hands them to a consumer."""
        from epd.v1 import encoder_pb2

        return encoder_pb2.GetTransferMetadataResponse(**dataclasses.asdict(self))

    @classmethod
    def from_wire(cls, response: encoder_pb2.GetTransferMetadataResponse) -> TransferCredentials:
        return cls(**{field.name: getattr(response, field.name) for field in dataclasses.fields(cls)})
