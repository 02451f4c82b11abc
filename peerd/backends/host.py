"""Host backend: anonymous shared memory, so all of peerd runs where no GPU is.

Host memory has no name anywhere. Each chunk of an arena (peerd.arena) is a
memfd the daemon creates and keeps open until it frees the chunk; the handle
is a random id that only tells chunks apart and grants nothing by itself. Members receive the fds
over the daemon's fd channel (peerd.fdchannel says why fds, not names), so
no other process can reach the memory, no name can be squatted, and the
kernel frees it once the daemon's fd and the members' mappings are gone: a
daemon that crashed leaves nothing behind, and nothing is keyed on its pid.

Reserving a chunk's pages (``posix_fallocate``: they are really there, so no
member takes a SIGBUS on first touch), zeroing a freed range and freeing them
run off the daemon's loop (peerd.backends.hostreserve); a chunk is ``ready`` once reserved, and
the daemon opens a set only when every chunk it uses is (peerd.rendezvous).

A reservation past the memory available does not fail cleanly: the kernel
reclaims, swaps, and calls the OOM killer on some process (under a memory
limit, the daemon's own cgroup's: the daemon itself). So a chunk is refused
up front when it would leave less than ``HEADROOM_SHARE`` of that memory
available (MemAvailable, and what the tightest limit on the daemon's cgroup
or its parents still allows, less the reservations still running), with
the numbers. Memory a freed chunk's close is about to give back counts as
available: the empty chunks given back for a set are still closing when
that set is tried again. Each step of a reservation checks the memory once
more, and waits for the closes under way where it is short
(peerd.backends.hostreserve), so such a chunk fails only where the closes
did not give the memory back.

MemAvailable alone is not enough: a member holds its chunk's memfd and may
punch the pages out (the seals cannot forbid that without forbidding
writes), so memory the daemon promised reads as available again, and the
next zeroing of a freed range reserves it once more. A member punching and
joining in turn made the daemon reserve more than its cgroup allowed, and
the OOM killer took it. So the chunks the daemon keeps may together never
promise more than the memory it may use less the headroom, whatever became
of their pages (``promised``), and a freed range is reserved again only
while the memory available, less the reservations under way, still leaves
the headroom; else that range fails the set handed it, and is tried again.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
from typing import TYPE_CHECKING

from ..arena import OverCap
from ..atomics import MADV_DONTFORK
from ..index import tally
from ..sizes import human
from . import Mapper as MapperBase
from . import AllocationFailed, ChunkMemory
from .hostreserve import Reservation, Reserver

if TYPE_CHECKING:
    from ..fdroom import FdRoom

DEVICE = "host"
#: what /proc/PID/fd and /proc/PID/maps show: /memfd:peerd
MEMFD_NAME = "peerd"
HANDLE_BYTES = 16
#: a member that resized a peer's memfd would SIGBUS everyone mapping it
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL

#: the share of the memory the daemon may use that a new chunk must leave available to everything else
HEADROOM_SHARE = 1 / 16
#: the share of the daemon's fd room (peerd.fdroom) chunks' memfds may fill, with whatever else is in it: the
#: rest stays for the pidfds, as a process the daemon cannot watch cannot join
CHUNKS_FD_SHARE = 0.75
#: the share of the fd room one uid's chunks may fill, so one user holding many chunks leaves the others room
CHUNKS_FD_SHARE_PER_UID = 1 / 8


class Memory(ChunkMemory):
    name = "host"
    free_needs_unmapped = False  # a worker's mmap keeps a memfd's pages alive after the daemon closes it
    ready_per_range = True  # a freed range is zeroed off the loop: it may go out at once, its set opens once done

    def __init__(self) -> None:
        self._fd_room: FdRoom | None = None  # the daemon's, shared before the first chunk
        self._reserver = Reserver(closed=self._closed, room=self._room_now)
        self.promised = 0  # bytes of the chunks kept, whatever became of their pages
        self._chunks_of: dict[int | None, int] = {}  # uid -> its chunks kept: each a memfd in the fd room
        self.ready_fd = self._reserver.wake_fd

    def share_fd_room(self, room: FdRoom) -> None:
        self._fd_room = room

    def devices(self) -> list[dict]:
        return [
            {
                "index": 0,
                "uuid": DEVICE,
                "pci_bus_id": None,
                "name": "shared memory (memfd)",
                "total_bytes": os.sysconf("SC_PHYS_PAGES") * mmap.PAGESIZE,
                "footprint_bytes": 0,
            }
        ]

    def allocate_chunk(self, nbytes: int, device: str, flags: int, uid: int | None = None) -> tuple[bytes, Reservation]:
        if device != DEVICE:
            raise self.unknown_device(device)
        on_credit = self._check_room(nbytes)
        self._take_fd_place(nbytes, uid)
        try:
            fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as err:  # each buffer is one of the daemon's fds: EMFILE is its open-file limit
            self._closed()
            hint = "; raise the daemon's open-file limit (LimitNOFILE)" if err.errno == errno.EMFILE else ""
            raise AllocationFailed(f"cannot create shared memory: {err}{hint}") from None
        try:
            os.ftruncate(fd, nbytes)  # zero-filled; reserved off the loop
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            handle = os.urandom(HANDLE_BYTES)
            reservation = self._reserver.reserve(fd, nbytes, uid, handle, on_credit)
            self.promised += nbytes
            tally(self._chunks_of, uid, 1)
            return handle, reservation
        except Exception as err:  # OSError, or no thread could be started to reserve it
            os.close(fd)
            self._closed()
            raise AllocationFailed(f"cannot create {nbytes} bytes of shared memory: {err}") from None

    def _take_fd_place(self, nbytes: int, uid: int | None) -> None:
        """A place in the fd room for a new memfd, while chunks fill less than their share of it and ``uid``'s
        less than its own; else OverCap (LIMIT_EXCEEDED), with the numbers."""
        room = self._fd_room
        if room is None:
            return
        kept, share = self._chunks_of.get(uid, 0), int(room.size * CHUNKS_FD_SHARE_PER_UID)
        if kept >= share:
            raise OverCap(
                f"no new chunk of {human(nbytes)} for uid {uid}: it keeps {kept} chunks, each a memfd the daemon "
                f"holds, and one uid may keep {share} ({CHUNKS_FD_SHARE_PER_UID:.1%} of the daemon's {room.size} "
                "spare file descriptors); release buffers you no longer use, or have the daemon's hard fd limit "
                "raised (LimitNOFILE= in its unit)"
            )
        if not room.take(within=CHUNKS_FD_SHARE):
            raise OverCap(
                f"no new chunk of {human(nbytes)} for uid {uid}: the daemon's memfds, pidfds and control page areas "
                f"take {room.used} of its {room.size} spare file descriptors, and chunks may fill "
                f"{CHUNKS_FD_SHARE:.0%} of them (the rest stays for the pidfds); release buffers you no longer use, "
                "or have the daemon's hard fd limit raised (LimitNOFILE= in its unit)"
            )

    def _closed(self) -> None:
        """A memfd closed (or never made): its place in the fd room is free again."""
        if self._fd_room is not None:
            self._fd_room.give()

    def _check_room(self, nbytes: int) -> bool:
        """AllocationFailed where ``nbytes`` more would promise more than the memory the daemon may use less
        the headroom, or leave less than the headroom available; whether it fits only on the memory of
        chunks being closed (then each step of it checks again: see peerd.backends.hostreserve)."""
        limit, available = _memory_room()
        available -= self._reserver.pending
        headroom = int(limit * HEADROOM_SHARE)
        on_credit = nbytes > available - headroom
        available += self._reserver.closing
        if nbytes > available - headroom:
            raise AllocationFailed(
                f"cannot reserve {nbytes} bytes ({human(nbytes)}) of shared memory: {human(max(available, 0))} are "
                f"available (MemAvailable, or the daemon's cgroup memory limit, less reservations under way, with "
                f"the memory of chunks being closed), and "
                f"the daemon leaves {human(headroom)} of {human(limit)} to everything else; release buffers or ask "
                "for less"
            )
        if self.promised + nbytes > limit - headroom:
            raise AllocationFailed(
                f"cannot reserve {nbytes} bytes ({human(nbytes)}) of shared memory: the daemon's chunks already "
                f"take {human(self.promised)} of the {human(limit - headroom)} it may promise ({human(limit)}, the "
                f"machine's or its cgroup's memory, less {human(headroom)} left to everything else); release "
                "buffers or ask for less"
            )
        return on_credit

    def ready(self, token: Reservation, span: tuple[int, int] | None = None) -> bool:
        return self._reserver.ready(token, span)

    def woken(self) -> list[bytes]:
        return [reservation.handle for reservation in self._reserver.woken()]

    def zero(self, token: Reservation, offset: int, nbytes: int) -> None:
        """Off the loop: the range's pages punched out (they read zero), then reserved again."""
        self._reserver.zero(token, offset, nbytes)

    def chunk_fd(self, token: Reservation) -> int:
        return token.fd

    def free_chunk(self, token: Reservation) -> None:
        if not token.freed:
            self.promised -= token.nbytes
            tally(self._chunks_of, token.uid, -1)
        self._reserver.free(token)  # the kernel frees the pages at the last close or unmap: off the loop

    def _room_now(self, nbytes: int) -> None:
        """AllocationFailed where reserving ``nbytes`` (a step of a chunk, or a freed range's pages just
        punched out; either counted in the reservations under way) would leave less than the headroom
        available now."""
        limit, available = _memory_room()
        headroom = int(limit * HEADROOM_SHARE)
        if available - self._reserver.pending < headroom:
            raise AllocationFailed(
                f"memory is short: {human(max(available, 0))} available, {human(self._reserver.pending)} of it "
                f"being reserved, and the daemon leaves {human(headroom)} to everything else, so {human(nbytes)} "
                "could not be reserved now"
            )

    def stopping(self) -> None:
        self._reserver.keep_pages()

    def close(self) -> None:
        self._reserver.close()


def _memory_room() -> tuple[int, int]:
    """(the memory the daemon may use, how much of it is available now): the machine's (physical
    memory, MemAvailable), or its cgroup's (memory.max, memory.max - memory.current) where lower."""
    limit = os.sysconf("SC_PHYS_PAGES") * mmap.PAGESIZE
    with open("/proc/meminfo", "rb") as meminfo:
        available = next((int(line.split()[1]) * 1024 for line in meminfo if line.startswith(b"MemAvailable:")), None)
    if available is None:
        raise AllocationFailed("/proc/meminfo has no MemAvailable: this kernel is too old for the host backend")
    cgroup = _cgroup_memory()
    if cgroup is not None:
        limit, available = min(limit, cgroup[0]), min(available, cgroup[0] - cgroup[1])
    return limit, available


def _cgroup_memory(membership: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> tuple[int, int] | None:
    """(limit, used) of the tightest memory limit on this process's cgroup and its parents (v2:
    memory.max and memory.current; v1: memory.limit_in_bytes and memory.usage_in_bytes), or None
    where none is set or none can be read."""
    try:
        with open(membership) as groups:
            lines = [line.rstrip("\n").split(":", 2) for line in groups]
    except OSError:
        return None
    found = []
    for _, controllers, path in (line for line in lines if len(line) == 3):
        if controllers == "":  # v2: the limit may sit on any ancestor (a slice, a pod)
            base, files = root, ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):  # v1
            base, files = os.path.join(root, "memory"), ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            limit = _read_limit(os.path.join(base, *parts[:depth]), files)
            if limit is not None:
                found.append(limit)
    return min(found, key=lambda f: f[0] - f[1], default=None)


def _read_limit(directory: str, files: tuple[str, str]) -> tuple[int, int] | None:
    try:
        with open(os.path.join(directory, files[0])) as limit, open(os.path.join(directory, files[1])) as used:
            most, current = limit.read().strip(), int(used.read())
    except (OSError, ValueError):
        return None
    if not most.isdigit() or int(most) >= 1 << 62:  # v2 writes "no limit" as "max", v1 as a huge number
        return None
    return int(most), current


# ---------------------------------------------------------------- the worker's half

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value


class Mapper(MapperBase):
    passes_fds = True

    def device_identity(self, index: int | None) -> str:
        return DEVICE

    def open(self, handle: bytes, size: int, fd: int | None = None) -> int:
        if fd is None:
            raise ValueError("host memory is mapped from the fd the daemon passes with its handle; none came")
        address = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if address in (None, _MAP_FAILED):
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of host chunk {handle.hex()} ({size} bytes) failed: {os.strerror(err)}")
        # a forked child (a data loader) would keep the chunk's pages mapped, writable, for its whole life,
        # after its parent released them; it may not touch them anyway (ForkedProcessError)
        _libc.madvise(address, size, MADV_DONTFORK)  # it fails only for a range that is not this mapping
        return address

    def close(self, address: int, size: int) -> None:
        if _libc.munmap(address, size) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"munmap at {address:#x} failed: {os.strerror(err)}")
