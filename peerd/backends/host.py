"""Host backend: anonymous shared memory, so all of peerd runs where no GPU is.

Host memory has no name anywhere. Each chunk of an arena (peerd.arena) is a
memfd the daemon creates and keeps open until it frees the chunk; the handle
is a random id that only tells chunks apart and grants nothing by itself. Members receive the fds
over the daemon's fd channel (peerd.fdchannel says why fds, not names), so
no other process can reach the memory, no name can be squatted, and the
kernel frees it once the daemon's fd and the members' mappings are gone: a
daemon that crashed leaves nothing behind, and nothing is keyed on its pid.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os

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

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


class Memory(ChunkMemory):
    name = "host"
    free_needs_unmapped = False  # a worker's mmap keeps a memfd's pages alive after the daemon closes it

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

    def allocate_chunk(self, nbytes: int, device: str, flags: int) -> tuple[bytes, int]:
        if device != DEVICE:
            raise self.unknown_device(device)
        try:
            fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as err:  # each buffer is one of the daemon's fds: EMFILE is its open-file limit
            hint = "; raise the daemon's open-file limit (LimitNOFILE)" if err.errno == errno.EMFILE else ""
            raise AllocationFailed(f"cannot create shared memory: {err}{hint}") from None
        try:
            os.posix_fallocate(fd, 0, nbytes)  # zero-filled, and really reserved: no SIGBUS on first touch
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        except OSError as err:
            os.close(fd)
            raise AllocationFailed(f"cannot reserve {nbytes} bytes of shared memory: {err}") from None
        return os.urandom(HANDLE_BYTES), fd

    def zero(self, token: int, offset: int, nbytes: int) -> None:
        """Punch the range's pages out (they read zero), then reserve them again: no SIGBUS on next touch."""
        if _libc.fallocate(token, PUNCH_HOLE, offset, nbytes) != 0:
            err = ctypes.get_errno()
            raise AllocationFailed(f"cannot zero {nbytes} bytes of shared memory: {os.strerror(err)}")
        try:
            os.posix_fallocate(token, offset, nbytes)
        except OSError as err:
            raise AllocationFailed(f"cannot reserve {nbytes} bytes of shared memory again: {err}") from None

    def chunk_fd(self, token: int) -> int:
        return token

    def free_chunk(self, token: int) -> None:
        os.close(token)  # the kernel frees the memory once no member maps it either


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
