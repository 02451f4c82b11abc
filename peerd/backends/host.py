"""Host backend: anonymous shared memory, so all of peerd runs where no GPU is.

Host memory has no name anywhere. Each buffer is a memfd the daemon creates
and keeps open until free(); the handle is a random id that only tells the
buffers of a set apart and grants nothing by itself. Members receive the fds
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

from .allocation import Allocation
from . import Mapper as MapperBase
from . import AllocationFailed, MemoryBackend, round_up

DEVICE = "host"
#: what /proc/PID/fd and /proc/PID/maps show: /memfd:peerd
MEMFD_NAME = "peerd"
HANDLE_BYTES = 16
#: a member that resized a peer's memfd would SIGBUS everyone mapping it
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class Memory(MemoryBackend):
    name = "host"

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

    def allocate(self, nbytes: int, device: str, flags: int, uid: int | None) -> Allocation:
        if device != DEVICE:
            raise self.unknown_device(device)
        size = round_up(nbytes, mmap.PAGESIZE)
        try:
            fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as err:  # each buffer is one of the daemon's fds: EMFILE is its open-file limit
            hint = "; raise the daemon's open-file limit (LimitNOFILE)" if err.errno == errno.EMFILE else ""
            raise AllocationFailed(f"cannot create shared memory: {err}{hint}") from None
        try:
            os.posix_fallocate(fd, 0, size)  # zero-filled, and really reserved: no SIGBUS on first touch
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        except OSError as err:
            os.close(fd)
            raise AllocationFailed(f"cannot reserve {size} bytes of shared memory: {err}") from None
        return Allocation(self.name, os.urandom(HANDLE_BYTES), size, DEVICE, token=fd)

    def fd(self, allocation: Allocation) -> int:
        return allocation.token

    def free(self, allocation: Allocation) -> None:
        os.close(allocation.token)  # the kernel frees the memory once no member maps it either


# ---------------------------------------------------------------- the worker's half

_libc = ctypes.CDLL(None, use_errno=True)
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
            raise OSError(err, f"mmap of host buffer {handle.hex()} ({size} bytes) failed: {os.strerror(err)}")
        return address

    def close(self, address: int, size: int) -> None:
        if _libc.munmap(address, size) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"munmap at {address:#x} failed: {os.strerror(err)}")
