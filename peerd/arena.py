"""Per-(uid, device) arenas: big chunks from the driver, buffers handed out as (chunk, offset).

Why: a driver allocation and its export cost ~0.4 ms each and a worker's
open ~0.45 ms per handle, and GPU allocations come in 2 MiB pieces. A chunk
is allocated and exported once, a worker opens it once per process, and
later buffers in it cost the daemon a free-list walk and the worker an
addition.

Pure bookkeeping: memory is reached only through a ``ChunkSource`` (the
backend's thin half: allocate, export, zero, free a chunk), so every rule
here is tested without a device.

Rules:

- **One uid per chunk.** A chunk serves the buffers of one uid on one
  device, never another's: mapping a chunk shows its own user's other
  buffers on that device, nothing more (docs/security.md).
- **Alignment** ``ALIGNMENT`` = 4 KiB, for every offset and size: a page,
  so the host backend zeroes a freed range by punching whole pages out of
  its memfd, and far above what device code assumes of a buffer (16-byte
  vector loads, 128-byte lines, the 256 bytes cudaMalloc guarantees, which
  the all-reduce's kernels were written against). 8 KiB asked is 8 KiB held.
- **First fit** over each chunk's free list (sorted by offset, neighbours
  coalesced on free): sets of one model ask for a handful of sizes, so the
  list stays short and first fit keeps the low end of a chunk packed.
- **Zero on reuse, waited for only when needed.** A freed range is zeroed at
  once and asynchronously (``zero``) and set aside (``zeroing``); it rejoins
  the free list only after the chunk's zeroes were waited for (``sync``), so
  every buffer reads zero. Ranges never handed out, or already settled, are
  taken first: a set made just after another was freed (an engine's next
  buffers, a restart of a job) waits for no device stream while its chunk has
  room; the wait comes when only zeroing ranges would fit, by then usually
  long done. Where the backend tells readiness by range (``ready_per_range``:
  host memory, zeroed on threads), nothing waits: a zeroing range goes out
  at once, and its set opens once it is zeroed, as a set waits for a chunk
  still being reserved. A new chunk is zeroed whole before its first buffer.
- **Big requests** (over a chunk) get a chunk of their own, returned to the
  driver as soon as that buffer is freed.
- **Ready before handed out.** A backend may reserve a new chunk's memory
  off the daemon's loop (the host backend: peerd.backends.host); the daemon
  opens a set only once every chunk it uses is ``ready``. A chunk whose
  memory could not be had after all is ``forsake``n: nothing more goes in
  it, and it goes back once its last buffer is released.
- **Nothing zeroed or freed at shutdown.** Once the daemon stops
  (``stopping``), a freed range is left as it is and never handed out
  again, and its chunk is not given back (``trim`` skips it, a chunk of
  its own included, whose mappers are not recorded): workers still map it
  and their kernels may still run on it (a zeroed flag under a spinning
  kernel reads as a peer's signal; a driver free under a mapping is
  undefined). The memory goes with the daemon's context, or with the last
  mapping of its fd.
- **Idle chunks go back**: a shared chunk empty for ``idle_s`` is freed
  (``sweep``; at once when ``idle_s`` is 0), and every empty chunk on
  ``trim`` (eviction, shutdown), but see Note [No free under a mapping].
- **Cap**: the bytes of chunks one uid may reserve, over all devices;
  ``OverCap`` names the numbers.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Container, Iterable, Protocol

from .index import Index, tally
from .sizes import human

log = logging.getLogger("peerd.arena")

# Note [No free under a mapping]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# NVIDIA and AMD document a cudaFree/hipFree of an exported allocation that another process
# still has open (cudaIpcOpenMemHandle) as undefined behaviour. A worker keeps a shared chunk
# mapped for as long as it lives (peerd_client.mappings), so the next buffer in it costs no
# open; so a shared chunk remembers the pids it was handed to (``handed``, when a set's
# handles go out) and goes back to the driver only once it is empty AND every one of those
# processes has exited (``process_gone``). A dedicated chunk (one buffer) needs no such
# record: every member unmaps it before it releases its hold, and it is freed once no rank
# holds it, as any buffer always was; but an eviction takes the hold from members that still
# map it, so ``release`` is told those live pids (``mapped_by``) and a chunk of any kind then
# goes back only once they have exited. Where the mapping itself keeps memory alive (memfds:
# ``ChunkSource.free_needs_unmapped`` False), none of this applies and chunks go back as
# soon as they are idle.

ALIGNMENT = 4096
DEFAULT_CHUNK_BYTES = 64 << 20
DEFAULT_IDLE_S = 30.0


def align(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


class OverCap(Exception):
    """A new chunk would take a uid past its cap, or the daemon past its fd room (peerd.backends.host): the
    daemon answers LIMIT_EXCEEDED."""


class ChunkSource(Protocol):
    """What an arena needs of a backend: chunks of device memory, exported once."""

    def allocate_chunk(self, nbytes: int, device: str, flags: int, uid: int | None = None) -> tuple[bytes, Any]:
        """A zero-filled chunk for ``uid``'s buffers: (its exported handle, the backend's token); raises
        AllocationFailed."""

    def ready(self, token: Any, span: tuple[int, int] | None = None) -> bool:
        """Whether the chunk (and where ``ready_per_range``, its range ``span``: offset, bytes) may be handed
        out yet; raises AllocationFailed where it never will be."""

    def zero(self, token: Any, offset: int, nbytes: int) -> None:
        """Start zeroing a range (it may run asynchronously until ``sync``)."""

    def sync(self, token: Any) -> None:
        """Wait for every zeroing started on this chunk."""

    def free_chunk(self, token: Any) -> None:
        """Give the chunk back to the driver, after or instead of the zeroing started on it: none may run
        into memory the driver gave to someone else."""

    #: freeing a chunk another process still maps is undefined: see Note [No free under a mapping]
    free_needs_unmapped: bool
    #: ``ready`` tells for a range whether its zeroing is done, so a range still zeroing may go out at once:
    #: its set opens once it is (peerd.rendezvous), and nothing waits in ``sync``
    ready_per_range: bool


@dataclass
class Chunk:
    id: int
    uid: int | None
    device: str
    flags: int
    size: int
    handle: bytes
    token: Any
    dedicated: bool  # one buffer too big for a shared chunk
    free: list[list[int]] = field(default_factory=list)  # [offset, length], sorted by offset, coalesced
    used: dict[int, int] = field(default_factory=dict)  # offset -> length handed out
    zeroing: list[tuple[int, int]] = field(default_factory=list)  # (offset, length) freed, zeroes not waited for
    empty_since: float | None = None
    mappers: set[int] = field(default_factory=set)  # live pids handed it: Note [No free under a mapping]
    forsaken: bool = False  # its memory could not be had after all: nothing more goes in, it goes once empty

    @property
    def handed_out(self) -> int:
        return sum(self.used.values())

    def take(self, size: int) -> int | None:
        """First fit: the offset of ``size`` bytes carved from the free list, or None."""
        for entry in self.free:
            offset, length = entry
            if length >= size:
                if length == size:
                    self.free.remove(entry)
                else:
                    entry[0], entry[1] = offset + size, length - size
                self.used[offset] = size
                return offset
        return None

    def give_back(self, offset: int, size: int) -> None:
        """Return a range to the free list, merged with its free neighbours."""
        at = bisect.bisect_left(self.free, [offset])
        self.free.insert(at, [offset, size])
        if at + 1 < len(self.free) and offset + size == self.free[at + 1][0]:
            self.free[at][1] += self.free.pop(at + 1)[1]
        if at > 0 and self.free[at - 1][0] + self.free[at - 1][1] == offset:
            self.free[at - 1][1] += self.free.pop(at)[1]


@dataclass(frozen=True)
class Placement:
    """Where a buffer lives: its chunk and its offset in it."""

    chunk: Chunk
    offset: int
    size: int


class Arenas:
    """Every chunk of every (uid, device), and the rules above."""

    def __init__(self, source: ChunkSource, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 cap_per_uid: int | None = None, idle_s: float = DEFAULT_IDLE_S):
        if chunk_bytes <= 0 or chunk_bytes % ALIGNMENT:
            raise ValueError(f"the chunk size must be a positive multiple of {ALIGNMENT} bytes, not {chunk_bytes}")
        self._source = source
        self.chunk_bytes = chunk_bytes
        self.cap_per_uid = cap_per_uid
        self.idle_s = idle_s
        self.chunks: dict[int, Chunk] = {}
        # kept as chunks come and go, so a placement, a cap check or a death costs the same however many
        # chunks other uids keep
        self._shared: Index[tuple[int | None, str, int], int, Chunk] = Index()  # (uid, device, flags) -> its
        # shared chunks, oldest first
        self._reserved: dict[int | None, int] = {}  # uid -> bytes of its chunks
        self._mapped: Index[int, int, Chunk] = Index()  # pid -> the shared chunks it was handed
        self._ids = itertools.count(1)
        self._stopping = False
        self._left_at_shutdown: set[int] = set()  # chunks with a range freed while stopping: never trimmed

    def reserved(self, uid: int | None) -> int:
        return self._reserved.get(uid, 0)

    def place(self, nbytes: int, device: str, flags: int, uid: int | None) -> Placement:
        """An aligned, zero-filled range of at least ``nbytes`` for ``uid`` on ``device``."""
        size = align(nbytes)
        if size <= self.chunk_bytes:
            # a list first: _usable may forsake, and so drop, a chunk of the index it walks
            shared = [c for c in list(self._shared.get((uid, device, flags), {}).values()) if self._usable(c)]
            for settle in (False, True):  # ranges ready now first; those still zeroing only when nothing else fits
                for chunk in shared:
                    if settle and chunk.zeroing:
                        self._settle(chunk)
                    offset = chunk.take(size)
                    if offset is not None:
                        return self._hand_out(chunk, offset, size)
        chunk = self._new_chunk(max(size, self.chunk_bytes), device, flags, uid, dedicated=size > self.chunk_bytes)
        return self._hand_out(chunk, chunk.take(size), size)

    def ready(self, chunk: Chunk, span: tuple[int, int] | None = None) -> bool:
        """Whether the chunk's memory (and a buffer's ``span`` of it: offset, bytes) may be handed out yet;
        where the backend could not have the chunk after all, it is forsaken and its error raised. A range
        that could not be zeroed raises too, and is tried again when it is next freed."""
        try:
            whole = self._source.ready(chunk.token)
        except Exception:
            self.forsake(chunk)
            raise
        if whole and span is not None and self._source.ready_per_range:
            return self._source.ready(chunk.token, span)
        return whole

    def _usable(self, chunk: Chunk) -> bool:
        """Not forsaken, and not failed since: a chunk whose memory could not be had takes nothing more,
        even where every set that knew of it failed before asking."""
        if not chunk.forsaken:
            with contextlib.suppress(Exception):  # forsaken by ready
                self.ready(chunk)
        return not chunk.forsaken

    def _hand_out(self, chunk: Chunk, offset: int, size: int) -> Placement:
        chunk.empty_since = None
        return Placement(chunk, offset, size)

    def _settle(self, chunk: Chunk) -> None:
        """Put the chunk's zeroing ranges back on its free list, once zeroed where the backend cannot tell
        ``ready`` by range (a device stream is waited for)."""
        if not self._source.ready_per_range:
            self._source.sync(chunk.token)
        for offset, size in chunk.zeroing:
            chunk.give_back(offset, size)
        chunk.zeroing.clear()

    def _new_chunk(self, size: int, device: str, flags: int, uid: int | None, dedicated: bool) -> Chunk:
        held = self.reserved(uid)
        if self.cap_per_uid is not None and held + size > self.cap_per_uid:
            raise OverCap(
                f"uid {uid} reserves {held} bytes ({human(held)}) of arena chunks and a new one of {size} bytes "
                f"({human(size)}) on {device} would pass its cap of {self.cap_per_uid} bytes "
                f"({human(self.cap_per_uid)}) (--arena-max-bytes-per-uid); release buffers it no longer uses"
            )
        handle, token = self._source.allocate_chunk(size, device, flags, uid=uid)
        chunk = Chunk(next(self._ids), uid, device, flags, size, handle, token, dedicated, free=[[0, size]])
        self.chunks[chunk.id] = chunk
        tally(self._reserved, uid, size)
        if not dedicated:
            self._shared.add((uid, device, flags), chunk.id, chunk)
        return chunk

    def handed(self, placements: list[Placement], pids: list[int]) -> None:
        """These processes were handed these buffers' chunks and may map them until they exit."""
        for placement in placements:
            if not placement.chunk.dedicated:
                self._mapped_by(placement.chunk, pids)

    def _mapped_by(self, chunk: Chunk, pids: Iterable[int]) -> None:
        """These live processes may map ``chunk`` until they exit: see Note [No free under a mapping]."""
        if self._source.free_needs_unmapped:
            chunk.mappers.update(pids)
            for pid in pids:
                self._mapped.add(pid, chunk.id, chunk)

    def process_gone(self, pid: int, now: float) -> list[Chunk]:
        """A process exited, and its mappings with it; the chunks that could go back now and did."""
        mapped = self._mapped.pop(pid, {}).values()
        for chunk in mapped:
            chunk.mappers.discard(pid)
        return self._free_idle(mapped, now)

    def forsake(self, chunk: Chunk) -> None:
        """The backend could not give the chunk's memory after all (a reservation off the loop failed):
        no buffer goes in it any more, and it goes back once its last buffer is released."""
        chunk.forsaken = True
        if not chunk.used and chunk.id in self.chunks:
            self._drop(chunk)

    def stopping(self) -> None:
        """Shutdown begins: see the rule "Nothing zeroed at shutdown"."""
        self._stopping = True

    def release(self, placement: Placement, now: float, mapped_by: Iterable[int] = ()) -> None:
        """A buffer nobody holds any more: zero its range for the next one, or free its own chunk.
        ``mapped_by``: live processes that hold it no more but may still map it (an eviction's)."""
        chunk = placement.chunk
        size = chunk.used.pop(placement.offset)
        if self._stopping:
            self._left_at_shutdown.add(chunk.id)  # left as it is: never handed out again, nor given back
            return
        if chunk.forsaken:
            if not chunk.used:
                self._drop(chunk)  # no process was handed it: its handles never went out
            return
        self._mapped_by(chunk, mapped_by)
        if (chunk.dedicated or self.idle_s == 0) and not chunk.used and not chunk.mappers:
            self._drop(chunk)  # nothing else will use it: zeroing it would be wasted
            return
        if not chunk.used:
            chunk.empty_since = now
        if chunk.dedicated:  # never placed in again: it goes back once its last mapper exits
            return
        # where zero raises at once (a driver refusing a memset) the range never rejoins the free list; its
        # chunk still goes back when idle
        self._source.zero(chunk.token, placement.offset, size)
        chunk.zeroing.append((placement.offset, size))

    def sweep(self, now: float) -> list[Chunk]:
        """Free the chunks empty for ``idle_s`` or longer; those freed."""
        return self._free_idle(self.chunks.values(), now)

    def _free_idle(self, chunks: Iterable[Chunk], now: float) -> list[Chunk]:
        """Free those of ``chunks`` empty for ``idle_s`` or longer (a chunk of its own: at all) that no live
        process maps; those freed."""
        idle = [c for c in chunks if c.empty_since is not None and not c.mappers
                and (c.dedicated or now - c.empty_since >= self.idle_s)]
        for chunk in idle:
            self._drop(chunk)
        return idle

    def trim(self, uids: Container[int | None] | None = None) -> list[Chunk]:
        """Free every empty chunk no live process maps (of ``uids`` alone, if given), now: after an
        eviction, at shutdown, or where a chunk could not be had; those freed."""
        empty = [c for c in self.chunks.values() if not c.used and not c.mappers
                 and c.id not in self._left_at_shutdown and (uids is None or c.uid in uids)]
        for chunk in empty:
            self._drop(chunk)
        return empty

    def next_sweep(self) -> float | None:
        """When the next empty chunk turns idle (a monotonic time), or None."""
        times = [c.empty_since + self.idle_s for c in self.chunks.values() if c.empty_since is not None and not c.mappers]
        return min(times, default=None)

    def _drop(self, chunk: Chunk) -> None:
        """Forget the chunk, then give it back to the driver. A driver that refuses (a device fault) costs
        that chunk's memory, logged; never the other chunks being freed, nor the death, eviction or
        shutdown that freed them."""
        del self.chunks[chunk.id]
        tally(self._reserved, chunk.uid, -chunk.size)
        self._shared.discard((chunk.uid, chunk.device, chunk.flags), chunk.id)
        for pid in chunk.mappers:
            self._mapped.discard(pid, chunk.id)
        try:
            self._source.free_chunk(chunk.token)
        except Exception:
            log.exception("giving chunk %d of uid %s on %s (%s) back to the driver failed; it is forgotten",
                          chunk.id, chunk.uid, chunk.device, human(chunk.size))

    def usage(self) -> list[dict[str, Any]]:
        """Reserved vs handed-out bytes by (device, uid): what status and the metrics show."""
        rows: dict[tuple[str, int | None], dict[str, Any]] = {}
        for c in list(self.chunks.values()):
            row = rows.setdefault((c.device, c.uid), {"device": c.device, "uid": c.uid, "chunks": 0,
                                                      "reserved_bytes": 0, "handed_out_bytes": 0})
            row["chunks"] += 1
            row["reserved_bytes"] += c.size
            row["handed_out_bytes"] += c.handed_out
        return [rows[k] for k in sorted(rows, key=lambda k: (k[0], -1 if k[1] is None else k[1]))]


def describe_usage(rows: list[dict[str, Any]]) -> list[str]:
    """One line per uid of a device's ``arenas`` (as status reports them), for people."""
    return [f"arena of uid {r['uid']}: {r['chunks']} chunk(s), {human(r['reserved_bytes'])} reserved, "
            f"{human(r['handed_out_bytes'])} handed out" for r in rows]
