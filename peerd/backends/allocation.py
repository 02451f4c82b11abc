"""What a backend hands the registry for one rank's buffer.

A plain record, apart from the rules that use it, so that a worker importing
``peerd.backends`` for its mappers loads nothing of the daemon's registry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Allocation:
    """One rank's buffer: its backend, its chunk's exported handle, size and device; opaque ``token`` is the
    allocator's own.

    The buffer is ``size`` bytes at ``offset`` in a chunk of ``chunk_size`` bytes (0: the buffer is the whole
    allocation), which a worker maps once, whole, and shares between every buffer it holds in it.
    """

    backend: str
    handle: bytes
    size: int
    device: str
    token: Any = None
    offset: int = 0
    chunk_size: int = 0

    @property
    def span(self) -> int:
        """The bytes a worker maps for it: its whole chunk."""
        return self.chunk_size or self.size
