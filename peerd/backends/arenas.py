"""The registry's memory: buffers carved from per-(uid, device) chunks of one backend.

``ArenaMemory`` joins the pure allocator (peerd.arena) to a backend's thin
``ChunkMemory``: the registry's allocate and free become a place and a
release in an arena, and each buffer goes out as its chunk's handle plus an
offset. A background thread gives chunks that stayed empty for
``idle_s`` back to the driver; a lock keeps it and the daemon's loop from
touching the arenas at once. A chunk is freed only when no set holds a
buffer in it and, on GPUs, no live process it was handed still maps it
(peerd.arena: Note [No free under a mapping]). A restarted daemon starts
with no chunks and sweeps nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

from ..arena import DEFAULT_CHUNK_BYTES, DEFAULT_IDLE_S, Arenas, OverCap, Placement, align
from ..fdroom import FdRoom
from ..sizes import human
from . import Allocation, AllocationFailed, ChunkMemory, MemoryBackend

log = logging.getLogger("peerd.arena")


@dataclass(frozen=True)
class ArenaSettings:
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    cap_per_uid: int | None = None
    idle_s: float = DEFAULT_IDLE_S


class ArenaMemory(MemoryBackend):
    def __init__(self, chunks: ChunkMemory, settings: ArenaSettings):
        self.chunks = chunks
        self.name = chunks.name
        self.arenas = Arenas(chunks, settings.chunk_bytes, settings.cap_per_uid, settings.idle_s)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._sweeper = threading.Thread(target=self._sweep_idle, name="peerd-arena-sweeper", daemon=True)
        self._sweeper.start()

    def devices(self) -> list[dict[str, Any]]:
        """The backend's devices, each with its arenas: reserved vs handed-out bytes by uid."""
        with self._lock:
            usage = self.arenas.usage()
        described = self.chunks.devices()
        for d in described:
            d["arenas"] = [{k: v for k, v in row.items() if k != "device"} for row in usage if row["device"] == d["uuid"]]
        return described

    def usage(self) -> list[dict[str, Any]]:
        """Reserved vs handed-out bytes by (device, uid), for the metrics."""
        with self._lock:
            return self.arenas.usage()

    def footprint(self, nbytes: int) -> int:
        return align(nbytes)

    def allocate(self, nbytes: int, device: str, flags: int, uid: int | None) -> Allocation:
        """A buffer in a chunk of ``uid``'s; where no new chunk can be had, the empty chunks nobody maps, kept
        only to be used again, go back first and it is tried once more: any uid's where memory was short,
        the uid's own where it reached its cap (its limits are not others' to pay)."""
        with self._lock:
            try:
                placement = self.arenas.place(nbytes, device, flags, uid)
            except (AllocationFailed, OverCap) as refused:
                over_cap = isinstance(refused, OverCap)
                freed = self.arenas.trim({uid} if over_cap else None)
                if not freed:
                    raise
                self._log_freed(freed, f"empty, and {f'uid {uid} was at its cap' if over_cap else 'memory was short'}")
                placement = self.arenas.place(nbytes, device, flags, uid)
        chunk = placement.chunk
        return Allocation(self.name, chunk.handle, placement.size, device, token=placement,
                          offset=placement.offset, chunk_size=chunk.size)

    @property
    def ready_fd(self) -> int | None:
        return self.chunks.ready_fd

    def woken(self) -> list[bytes]:
        return self.chunks.woken()

    def ready(self, allocation: Allocation) -> bool:
        placement: Placement = allocation.token
        with self._lock:
            return self.arenas.ready(placement.chunk, (placement.offset, placement.size))

    def free(self, allocation: Allocation, mapped_by: Sequence[int] = ()) -> None:
        placement: Placement = allocation.token
        with self._lock:
            self.arenas.release(placement, time.monotonic(), mapped_by)
            if placement.chunk.empty_since is not None:  # only an emptied chunk brings the next sweep nearer:
                self._wake.notify()  # waking the sweeper on every free made the loop wait for the lock

    def fd(self, allocation: Allocation) -> int | None:
        return self.chunks.chunk_fd(allocation.token.chunk.token)

    def handed(self, allocations: list[Allocation], pids: list[int]) -> None:
        with self._lock:
            self.arenas.handed([a.token for a in allocations], pids)

    def process_gone(self, pid: int) -> None:
        with self._lock:
            self._log_freed(self.arenas.process_gone(pid, time.monotonic()), "empty, and its last mapper exited")
            self._wake.notify()

    def share_fd_room(self, room: FdRoom) -> None:
        self.chunks.share_fd_room(room)

    def trim(self) -> None:
        """Give every empty chunk back now (after an eviction)."""
        with self._lock:
            self._log_freed(self.arenas.trim(), "empty")

    def stopping(self) -> None:
        with self._lock:
            self.arenas.stopping()
        self.chunks.stopping()

    def close(self) -> None:
        """Shutdown: every empty chunk goes back, then the backend closes."""
        with self._lock:
            self._closed = True
            self._wake.notify()
            self._log_freed(self.arenas.trim(), "empty at shutdown")
        self._sweeper.join()
        self.chunks.close()

    def _sweep_idle(self) -> None:
        with self._lock:
            while not self._closed:
                due = self.arenas.next_sweep()
                if due is not None and due <= time.monotonic():
                    try:
                        self._log_freed(self.arenas.sweep(time.monotonic()), f"idle for {self.arenas.idle_s:g}s")
                        continue
                    except Exception:  # a bug must cost one sweep, never the thread: idle chunks would stay forever
                        log.exception("sweeping the idle chunks failed; trying again in a second")
                        due = time.monotonic() + 1.0
                self._wake.wait(None if due is None else due - time.monotonic())

    @staticmethod
    def _log_freed(freed: list, why: str) -> None:
        for chunk in freed:
            log.info("chunk %d of uid %s on %s (%s) given back to the driver: %s",
                     chunk.id, chunk.uid, chunk.device, human(chunk.size), why)
