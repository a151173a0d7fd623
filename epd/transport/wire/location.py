"""The parts of a NIXL location that need no NIXL: its descriptor format, its tag, and the checks
any service can run on a location before it reaches an engine (:func:`location_problems`).

Descriptors travel in EPD's own format (a version byte, then packed rows), not NIXL's
``get_serialized_descs``, which is a pickle: a consumer would otherwise unpickle bytes that
arrived over the network.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import struct
from collections.abc import Sequence

from epd.domain import NixlLocation

Row = tuple[int, int, int]
"""One contiguous DRAM range as NIXL describes it: (address, length in bytes, device id)."""

LEASE_ID_BYTES = 16
LEASE_ID = re.compile(rf"[0-9a-f]{{{2 * LEASE_ID_BYTES}}}")
TAG_BYTES = 32
_TAG_CONTEXT = b"epd-nixl-location-v2"
_DESCRIPTORS_VERSION = 1
_DESCRIPTOR_ROW = struct.Struct("<QQI")  # address, length, device id
_PART_LENGTH = struct.Struct("<I")


class LocationSigner:
    """Tags locations under one producer's key: HMAC-SHA256 of a location's fields but the tag
    itself, each length-prefixed so none can bleed into another.

    The key schedule (and the context prefix) is hashed once, here, and copied per location: a
    consumer checks one tag per READ on its engine's scheduler thread, a producer makes one per
    published item (1.7 us a tag against 2.7 keying HMAC afresh).

    ``encoder_address`` is left out on purpose: the key is only ever fetched from that address,
    so a location pointing elsewhere cannot verify under the real encoder's key anyway.
    """

    def __init__(self, key: bytes) -> None:
        self._keyed = hmac.new(key, _TAG_CONTEXT, hashlib.sha256)

    def tag(self, location: NixlLocation) -> bytes:
        agent, lease, descriptors = location.agent_name.encode(), location.lease_id.encode(), location.descriptors
        nbytes, expires, generation = b"%d" % location.nbytes, b"%d" % location.expires_at_unix_ms, b"%d" % location.slot_generation
        length = _PART_LENGTH.pack
        digest = self._keyed.copy()
        digest.update(
            b"".join((
                length(len(agent)), agent, length(len(lease)), lease, length(len(descriptors)), descriptors,
                length(len(nbytes)), nbytes, length(len(expires)), expires, length(len(generation)), generation,
            ))
        )  # fmt: skip
        return digest.digest()

    def verifies(self, location: NixlLocation) -> bool:
        return hmac.compare_digest(self.tag(location), location.tag)


def location_problems(location: NixlLocation) -> list[tuple[str, str]]:
    """(field, problem) for each part of a location that cannot be right, whoever sent it.

    Only the form: whether the location is genuine, only the encoder's key can tell
    (:meth:`LocationSigner.verifies`, in the consumer engine).
    """
    problems = []
    if not location.agent_name:
        problems.append(("agent_name", "must be set"))
    host, separator, port = location.encoder_address.rpartition(":")
    if not separator or not host or not port.isdigit() or not 0 < int(port) < 65536:
        problems.append(("encoder_address", f"must be 'host:port', got {location.encoder_address!r}"))
    if not LEASE_ID.fullmatch(location.lease_id):
        problems.append(("lease_id", f"must be {2 * LEASE_ID_BYTES} lowercase hex digits"))
    if len(location.tag) != TAG_BYTES:
        problems.append(("location_tag", f"must be {TAG_BYTES} bytes, got {len(location.tag)}"))
    try:
        rows = decode_descriptors(location.descriptors)
    except ValueError as exc:
        problems.append(("descriptors", str(exc)))
    else:
        if sum(length for _, length, _ in rows) != location.nbytes:
            problems.append(("nbytes", "must equal the descriptors' total length"))
    return problems


def encode_descriptors(rows: Sequence[Row]) -> bytes:
    return bytes([_DESCRIPTORS_VERSION]) + b"".join(_DESCRIPTOR_ROW.pack(*row) for row in rows)


def decode_descriptors(blob: bytes) -> list[Row]:
    """Raises ValueError for anything but this module's format."""
    version, body = blob[:1], blob[1:]
    if version != bytes([_DESCRIPTORS_VERSION]) or not body or len(body) % _DESCRIPTOR_ROW.size:
        raise ValueError("malformed NIXL descriptors")
    return [(address, length, device) for address, length, device in _DESCRIPTOR_ROW.iter_unpack(body)]
