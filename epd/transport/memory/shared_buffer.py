"""A named shared-memory buffer that every process of one vLLM engine can map.

vLLM runs an EC connector twice per engine: once beside the scheduler (which decides what moves
where and, here, owns the NIXL agent) and once in each worker (which holds the encoder cache).
With one worker they share the engine-core process; with tensor parallelism the workers are
processes of their own. A file in ``/dev/shm`` mapped by every one of them gives all of them the
same bytes: the scheduler side registers its mapping with NIXL, a producer's worker copies
encoder outputs into it, a consumer's worker hands views of it to its encoder cache.

The file name carries the creator's PID, so a later start can remove files whose creator died
without cleaning up (:func:`remove_stale`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib

import torch

logger = logging.getLogger(__name__)

_SHM_DIR = pathlib.Path("/dev/shm")
_PREFIX = "epd-ec-"


class SharedBuffer:
    """A ``/dev/shm`` file mapped as one contiguous ``torch.uint8`` tensor."""

    def __init__(self, path: pathlib.Path, tensor: torch.Tensor, *, owner: bool) -> None:
        self.path = path
        self.tensor = tensor
        self._owner = owner

    @classmethod
    def create(cls, name: str, nbytes: int) -> SharedBuffer:
        """Creates (or takes over) the buffer called ``name`` with ``nbytes`` zeroed bytes."""
        if nbytes <= 0:
            raise ValueError(f"a shared buffer needs a positive size, got {nbytes}")
        remove_stale()
        path = owned_path(name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        return cls(path, torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8), owner=True)

    @classmethod
    def attach(cls, name: str) -> SharedBuffer:
        """Maps the buffer another process created under ``name``.

        Raises:
            FileNotFoundError: nobody created it (yet).
        """
        path = find(name)
        nbytes = path.stat().st_size
        return cls(path, torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8), owner=False)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    def close(self) -> None:
        """Removes the file if this process created it. Mappings stay valid until dropped."""
        if self._owner:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            self._owner = False


def owned_path(name: str) -> pathlib.Path:
    """This process's file called ``name`` (a buffer, or a socket beside one): the PID in the
    file name lets a later start remove it if this process dies without doing so."""
    return _SHM_DIR / f"{_PREFIX}{name}.{os.getpid()}"


def find(name: str) -> pathlib.Path:
    """The file another process made under ``name`` (:func:`owned_path`).

    Raises:
        FileNotFoundError: nobody made it (yet).
    """
    matches = sorted(_SHM_DIR.glob(f"{_PREFIX}{name}.*"))
    if not matches:
        raise FileNotFoundError(f"no shared buffer named {name!r} in {_SHM_DIR}")
    return matches[-1]


def remove_stale() -> None:
    """Deletes buffers whose creating process no longer exists (it was killed, say)."""
    for path in _SHM_DIR.glob(f"{_PREFIX}*"):
        pid_text = path.suffix.removeprefix(".")
        if not pid_text.isdigit():
            continue
        try:
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                logger.info("removed stale shared buffer %s", path)
        except PermissionError:
            pass  # alive, owned by someone else
