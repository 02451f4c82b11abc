"""Opened chunks, cached per process and counted.

The daemon hands out buffers as (chunk, offset) (peerd.arena), and a handle
names a whole chunk, which the driver maps at most once per process
(depending on the version, CUDA refuses or reference-counts a second
cudaIpcOpenMemHandle of one handle; HIP may hand back a different pointer
each time). So every PeerBuffer of this process in one chunk shares one
mapping, keyed by the daemon run (its pid and instance id: in a container
a restarted daemon may get its predecessor's pid) and the handle bytes,
never by the pointer: a restarted daemon's chunks are never mistaken for
its predecessor's.

A shared GPU chunk no buffer of this process uses any more stays mapped
until the process exits, so the next buffer in it needs no open (a warm
setup is then pointer arithmetic); the daemon frees such a chunk only once
every process it was handed to has exited (peerd.arena: Note [No free
under a mapping]). A host chunk stays only until the process maps another
(Note [Given-back host chunks]): a view of a closed buffer may then point
at nothing, as PeerBuffer.close() says it must not be used. A buffer that
is its whole chunk (a dedicated chunk) is unmapped as soon as no buffer of
this process uses it, before the release that lets the daemon free it; so
is every chunk of a daemon run that ended
(``retire``): no buffer will be in it again, and its mapping alone kept the
dead daemon's memory for the worker's whole life, more at every restart.
A forked child inherits none of it: its driver state is not its parent's.

Note [Given-back host chunks]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The host backend gives an idle chunk back under live mappings (its pages
are punched first: no memory stays), and no worker hears of it. A worker
that kept every such chunk mapped grew by a chunk of address space and a
mapping per idle cycle for its whole life. So a chunk the host backend
passes as an fd stays mapped only until this process maps another one
while no buffer of it uses the first; a set whose chunks are all still
mapped claims them (``claim``) and fetches no fd, and one that finds any
missing fetches every fd of the set, so a chunk let go meanwhile by another
thread is mapped again from its fd. GPU chunks are never given back under
a mapping (the daemon waits for their mappers), so theirs stay.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

from peerd.backends import Mapper

log = logging.getLogger("peerd_client")

DaemonRun = tuple[int, "int | None"]  # (daemon pid, instance id: None from a daemon that announces none)
ChunkKey = tuple[DaemonRun, bytes]  # (daemon run, chunk handle)


@dataclass
class _Mapping:
    address: int
    size: int
    mapper: Mapper
    users: int
    transient: bool  # unmapped once unused: one buffer is the whole chunk, or the daemon run that made it ended


class MappingCache:
    def __init__(self) -> None:
        # reentrant: a garbage-collection pass inside open() may close a collected buffer's mappings
        self._lock = threading.RLock()
        self._open: dict[ChunkKey, _Mapping] = {}

    def claim(self, keys: list[ChunkKey]) -> bool:
        """One more user of each of ``keys`` (a key once per buffer in it), where every one is mapped: the
        set needs no fd then. Else nothing, and the set's buffers are opened from their fds."""
        with self._lock:
            if not all(key in self._open for key in keys):
                return False
            for key in keys:
                self._open[key].users += 1
            return True

    def address(self, key: ChunkKey) -> int:
        """The address of a chunk this process uses (claimed or opened)."""
        return self._open[key].address

    def open(self, mapper: Mapper, key: ChunkKey, size: int, fd: int | None = None, whole: bool = False) -> int:
        """The chunk's address, mapped (from ``fd`` where the backend passes fds) on first use; ``whole``:
        the buffer is the whole chunk. A new chunk from fds first unmaps the fd-passed chunks no buffer of
        this process uses: see Note [Given-back host chunks]."""
        with self._lock:
            mapping = self._open.get(key)
            if mapping is None:
                if mapper.passes_fds:
                    self._unmap([k for k, m in self._open.items() if m.users == 0 and m.mapper.passes_fds])
                mapping = self._open[key] = _Mapping(mapper.open(key[1], size, fd), size, mapper, 0, whole)
            mapping.users += 1
            return mapping.address

    def close(self, key: ChunkKey) -> None:
        """One user fewer; a whole-chunk buffer's mapping goes once it has none, a shared chunk's stays."""
        with self._lock:
            mapping = self._open[key]
            mapping.users -= 1
            if mapping.users == 0 and mapping.transient:
                self._unmap([key])

    def retire(self, run: DaemonRun) -> None:
        """Daemon run ``run`` ended: its chunks no buffer uses go now, the rest at their last close."""
        with self._lock:
            for key, mapping in list(self._open.items()):
                if key[0] == run:
                    mapping.transient = True
                    if mapping.users == 0:
                        self._unmap([key])

    def unmap_unused(self) -> None:
        """Unmap every chunk no buffer of this process uses now: its next buffer opens afresh."""
        with self._lock:
            self._unmap([k for k, m in self._open.items() if m.users == 0])

    def _unmap(self, keys: list[ChunkKey]) -> None:
        for key in keys:
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
