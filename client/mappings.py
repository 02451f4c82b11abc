"""Opened chunks, cached per process and counted.

The daemon hands out buffers as (chunk, offset) (peerd.arena), and a handle
names a whole chunk, which the driver maps at most once per process
(depending on the version, CUDA refuses or reference-counts a second
cudaIpcOpenMemHandle of one handle; HIP may hand back a different pointer
each time). So every PeerBuffer of this process in one chunk shares one
mapping, keyed by the daemon's pid and the handle bytes, never by the
pointer: a restarted daemon's chunks are never mistaken for its
predecessor's.

A chunk no buffer of this process uses any more stays mapped for
``KEEP_S``, so the next buffer in it needs no open (a warm setup is then
pointer arithmetic); it is unmapped at the first open or close of this
process after that, or when the process exits. KEEP_S is shorter than the
daemon's default --arena-idle-s (30 s), so a process that keeps making
buffers has let go of a chunk before the daemon frees it: NVIDIA documents
a cudaFree of an exported allocation that a process still has open as
undefined (memfds are simply kept alive by the mapping). A process that
makes no further call keeps its unused chunks mapped until it exits: at
most the idle chunks of its own uid.
A forked child inherits none of it: its driver state is not its parent's.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

from peerd.backends import Mapper

log = logging.getLogger("peerd_client")

#: seconds an unused chunk stays mapped, waiting for the next buffer in it
KEEP_S = 10.0

ChunkKey = tuple[int, bytes]  # (daemon pid, chunk handle)


@dataclass
class _Mapping:
    address: int
    size: int
    mapper: Mapper
    users: int
    unused_since: float | None = None


class MappingCache:
    def __init__(self) -> None:
        # reentrant: a garbage-collection pass inside open() may close a collected buffer's mappings
        self._lock = threading.RLock()
        self._open: dict[ChunkKey, _Mapping] = {}

    def mapped(self, key: ChunkKey) -> bool:
        return key in self._open

    def open(self, mapper: Mapper, key: ChunkKey, size: int, fd: int | None = None) -> int:
        """The chunk's address, mapped (from ``fd`` where the backend passes fds) on first use."""
        with self._lock:
            self._unmap_unused(time.monotonic())
            mapping = self._open.get(key)
            if mapping is None:
                mapping = self._open[key] = _Mapping(mapper.open(key[1], size, fd), size, mapper, 0)
            mapping.users += 1
            mapping.unused_since = None
            return mapping.address

    def close(self, key: ChunkKey) -> None:
        """One user fewer; the chunk stays mapped for KEEP_S once it has none."""
        with self._lock:
            now = time.monotonic()
            mapping = self._open[key]
            mapping.users -= 1
            if mapping.users == 0:
                mapping.unused_since = now
            self._unmap_unused(now)

    def unmap_unused(self) -> None:
        """Unmap every chunk no buffer of this process uses now: its next buffer opens afresh."""
        with self._lock:
            self._unmap_unused(float("inf"))

    def _unmap_unused(self, now: float) -> None:
        stale = [k for k, m in self._open.items() if m.unused_since is not None and now - m.unused_since >= KEEP_S]
        for key in stale:
            mapping = self._open.pop(key)
            try:
                mapping.mapper.close(mapping.address, mapping.size)
            except Exception as err:  # the mapping is forgotten either way; the caller's buffer is not at fault
                log.warning("unmapping an unused peer memory chunk failed: %s", err)

    def __len__(self) -> int:
        return len(self._open)

    def forget(self) -> None:
        self._open = {}
        self._lock = threading.RLock()


mappings = MappingCache()
os.register_at_fork(after_in_child=mappings.forget)
