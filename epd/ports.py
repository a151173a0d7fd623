"""Choosing listening ports that a service must announce before the listener exists.

vLLM's NIXL side channel and NIXL's metadata listener must be told their port up front, and bind
it only later (tens of seconds later, for an engine still loading). A port taken from the OS's
ephemeral range in the meantime can be handed to any other socket on the host. So ports are
drawn at random from below that range, where the OS never assigns one by itself, and probed.
"""

from __future__ import annotations

import pathlib
import random
import socket

_FLOOR = 20_000
_DEFAULT_EPHEMERAL_START = 32_768
_ATTEMPTS = 64


def free_port(host: str = "") -> int:
    """A port that is free on ``host`` now and outside the ephemeral range.

    Raises:
        OSError: no free port was found.
    """
    ceiling = _ephemeral_start()
    for _ in range(_ATTEMPTS):
        port = random.randrange(_FLOOR, ceiling)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port in [{_FLOOR}, {ceiling}) after {_ATTEMPTS} tries")


def _ephemeral_start() -> int:
    try:
        start = int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _DEFAULT_EPHEMERAL_START
    return start if start > _FLOOR + 1000 else _DEFAULT_EPHEMERAL_START
