"""Lets vLLM's CPU attention use AMX in every engine process.

On x86 CPUs with AMX (Sapphire Rapids and later), Linux traps the first AMX instruction of a
process with SIGILL unless the process asked for the tile state first
(``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``). vLLM's CPU attention picks its AMX
kernel for bfloat16 and never asks; a monolithic engine gets away with it because something in
its warm-up happens to ask, but a KV-consumer engine (decode) runs the kernel first and dies
with SIGILL. The CPU install runs :func:`request_tile_permission` at every interpreter start
(the same ``.pth`` hook as ``torchvision_cpu``); it is a no-op where AMX is absent.
"""

from __future__ import annotations

import ctypes
import platform

_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18
_SYS_ARCH_PRCTL = 158  # x86_64


def request_tile_permission() -> bool:
    """Asks Linux for the AMX tile state; True if granted (False where there is no AMX)."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except OSError:
        return False
