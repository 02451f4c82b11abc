"""Host backend: anonymous shared memory, so all of peerd runs where no GPU is.

Host memory has no name anywhere. Each chunk of an arena (peerd.arena) is a
memfd the daemon creates and keeps open until it frees the chunk; the handle
is a random id that only tells chunks apart and grants nothing by itself. Members receive the fds
over the daemon's fd channel (peerd.fdchannel says why fds, not names), so
no other process can reach the memory, no name can be squatted, and the
kernel frees it once the daemon's fd and the members' mappings are gone: a
daemon that crashed leaves nothing behind, and nothing is keyed on its pid.

Reserving a chunk's pages (``posix_fallocate``: they are really there, so no
member takes a SIGBUS on first touch) costs about 0.25 s per GiB, and the
kernel frees them as slowly at the last close: on the daemon's loop, one
user's 16 GiB buffer would stall every other user's setup, agreement and
death notice for seconds. Both run on worker threads instead (the system
calls release the GIL); a chunk is ``ready`` once reserved, and the daemon
opens a set only when every chunk it uses is (peerd.rendezvous).

A reservation past the memory the machine has available does not fail
cleanly: the kernel reclaims, swaps, and may call the OOM killer on any
process. So a chunk is refused up front when it would leave less than
``HEADROOM_SHARE`` of the machine's memory available (MemAvailable, less the
reservations still running), with the numbers.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from ..sizes import human
from . import Mapper as MapperBase
from . import AllocationFailed, ChunkMemory

DEVICE = "host"
#: what /proc/PID/fd and /proc/PID/maps show: /memfd:peerd
MEMFD_NAME = "peerd"
HANDLE_BYTES = 16
#: a member that resized a peer's memfd would SIGBUS everyone mapping it
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
#: fallocate(2) mode that frees a range's pages, keeping the file's size (allowed on a memfd sealed as above)
PUNCH_HOLE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE

#: threads reserving or freeing chunks' pages at once: one user's huge chunk does not hold up everyone's small ones
MEMORY_THREADS = 4
#: the share of the machine's memory a new chunk must leave available to everything else
HEADROOM_SHARE = 1 / 16

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


@dataclass(frozen=True)
class HostChunk:
    """A chunk's memfd (the daemon's reference) and its reservation, running or done."""

    fd: int
    reserved: Future


class Memory(ChunkMemory):
    name = "host"
    free_needs_unmapped = False  # a worker's mmap keeps a memfd's pages alive after the daemon closes it

    def __init__(self) -> None:
        self._slow = ThreadPoolExecutor(MEMORY_THREADS, thread_name_prefix="peerd-host-memory")
        self.ready_fd, self._ready_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._reserving = 0  # bytes of reservations still running: not yet out of MemAvailable
        self._reserving_lock = threading.Lock()

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

    def allocate_chunk(self, nbytes: int, device: str, flags: int) -> tuple[bytes, HostChunk]:
        if device != DEVICE:
            raise self.unknown_device(device)
        self._check_room(nbytes)
        try:
            fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as err:  # each buffer is one of the daemon's fds: EMFILE is its open-file limit
            hint = "; raise the daemon's open-file limit (LimitNOFILE)" if err.errno == errno.EMFILE else ""
            raise AllocationFailed(f"cannot create shared memory: {err}{hint}") from None
        try:
            os.ftruncate(fd, nbytes)  # zero-filled; reserved on a thread, below
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            reserving = os.dup(fd)  # the thread's own reference: a free meanwhile closes only the daemon's
        except OSError as err:
            os.close(fd)
            raise AllocationFailed(f"cannot create {nbytes} bytes of shared memory: {err}") from None
        with self._reserving_lock:
            self._reserving += nbytes
        reserved = self._slow.submit(_reserve, reserving, nbytes)
        reserved.add_done_callback(lambda _: self._reserved(nbytes))  # a wake-up before would find it running
        return os.urandom(HANDLE_BYTES), HostChunk(fd, reserved)

    def _check_room(self, nbytes: int) -> None:
        """AllocationFailed where ``nbytes`` more would leave the machine less than its headroom."""
        total = os.sysconf("SC_PHYS_PAGES") * mmap.PAGESIZE
        with self._reserving_lock:
            available = _mem_available() - self._reserving
        headroom = int(total * HEADROOM_SHARE)
        if nbytes > available - headroom:
            raise AllocationFailed(
                f"cannot reserve {nbytes} bytes ({human(nbytes)}) of shared memory: the machine has "
                f"{human(max(available, 0))} available (MemAvailable, less reservations under way), and the daemon "
                f"leaves {human(headroom)} of its {human(total)} to everything else; release buffers or ask for less"
            )

    def _reserved(self, nbytes: int) -> None:
        """A reservation ended, on its thread: its pages are in MemAvailable's count now; wake the loop."""
        with self._reserving_lock:
            self._reserving -= nbytes
        with contextlib.suppress(OSError):  # a full pipe is readable already; a closed one: shutting down
            os.write(self._ready_w, b"\0")

    def ready(self, token: HostChunk) -> bool:
        if not token.reserved.done():
            return False
        token.reserved.result()  # raises the reservation's AllocationFailed
        return True

    def zero(self, token: HostChunk, offset: int, nbytes: int) -> None:
        """Punch the range's pages out (they read zero), then reserve them again: no SIGBUS on next touch.
        On the loop: a range of a shared chunk, at most --arena-chunk-bytes (64 MiB, about 15 ms)."""
        if _libc.fallocate(token.fd, PUNCH_HOLE, offset, nbytes) != 0:
            err = ctypes.get_errno()
            raise AllocationFailed(f"cannot zero {nbytes} bytes of shared memory: {os.strerror(err)}")
        try:
            os.posix_fallocate(token.fd, offset, nbytes)
        except OSError as err:
            raise AllocationFailed(f"cannot reserve {nbytes} bytes of shared memory again: {err}") from None

    def chunk_fd(self, token: HostChunk) -> int:
        return token.fd

    def free_chunk(self, token: HostChunk) -> None:
        # the kernel frees the pages at the last close or unmap: when that is this close, on a thread
        self._slow.submit(os.close, token.fd)

    def close(self) -> None:
        self._slow.shutdown(wait=True, cancel_futures=True)
        for fd in (self.ready_fd, self._ready_w):
            os.close(fd)


def _mem_available() -> int:
    """The kernel's estimate of the memory available without swapping (/proc/meminfo MemAvailable)."""
    with open("/proc/meminfo", "rb") as meminfo:
        for line in meminfo:
            if line.startswith(b"MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise AllocationFailed("/proc/meminfo has no MemAvailable: this kernel is too old for the host backend")


def _reserve(fd: int, nbytes: int) -> None:
    """Really reserve a chunk's pages (no SIGBUS on first touch), on a thread; ``fd`` is spent."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as err:
        raise AllocationFailed(f"cannot reserve {nbytes} bytes of shared memory: {err}") from None
    finally:
        os.close(fd)


# ---------------------------------------------------------------- the worker's half

_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
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
        return address

    def close(self, address: int, size: int) -> None:
        if _libc.munmap(address, size) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"munmap at {address:#x} failed: {os.strerror(err)}")
