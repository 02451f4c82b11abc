"""Opened handles, cached per process and counted.

A handle names a whole allocation, and the driver maps it at most once per
process (depending on the version, CUDA refuses or reference-counts a
second cudaIpcOpenMemHandle of one handle; HIP may hand back a different
pointer each time). So every PeerBuffer of this
process that needs a handle shares one mapping, keyed by the handle bytes,
never by the pointer, and the mapping is closed when its last user lets go.
A forked child inherits none of it: its driver state is not its parent's.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from peerd.backends import Mapper


@dataclass
class _Mapping:
    address: int
    size: int
    mapper: Mapper
    users: int


class MappingCache:
    def __init__(self) -> None:
        # reentrant: a garbage-collection pass inside open() may close a collected buffer's mappings
        self._lock = threading.RLock()
        self._open: dict[bytes, _Mapping] = {}

    def open(self, mapper: Mapper, handle: bytes, size: int, fd: int | None = None) -> int:
        """The handle's address, mapped (from ``fd`` where the backend passes fds) on first use."""
        with self._lock:
            mapping = self._open.get(handle)
            if mapping is None:
                mapping = self._open[handle] = _Mapping(mapper.open(handle, size, fd), size, mapper, 0)
            mapping.users += 1
            return mapping.address

    def close(self, handle: bytes) -> None:
        with self._lock:
            mapping = self._open[handle]
            mapping.users -= 1
            if mapping.users == 0:
                del self._open[handle]
                mapping.mapper.close(mapping.address, mapping.size)

    def __len__(self) -> int:
        return len(self._open)

    def forget(self) -> None:
        self._open = {}
        self._lock = threading.RLock()


mappings = MappingCache()
os.register_at_fork(after_in_child=mappings.forget)
