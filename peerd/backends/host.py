"""Host backend: POSIX shared memory, so all of peerd runs where no GPU is.

The handle is the segment's name. The daemon creates the segment (ftruncate
zero-fills it) and unlinks it when freed; a worker that still has it mapped
keeps its pages until it unmaps, exactly as a GPU IPC mapping outlives
nothing but its own close. Segment names carry the daemon's pid, so a daemon
started after a crash can sweep what the dead one left in /dev/shm.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import logging
import mmap
import os
import re

from ..groups import Allocation
from ..protocol import ErrorCode, ProtocolError
from . import Mapper as MapperBase
from ..liveness import pid_alive
from . import BackendUnavailable, MemoryBackend, round_up

log = logging.getLogger("peerd.backends.host")

SHM_DIR = "/dev/shm"
PREFIX = "peerd-"
DEVICE = "host"
_NAME = re.compile(rf"^{PREFIX}(\d+)-\d+$")


def sweep_orphans() -> list[str]:
    """Unlink segments left by peerd daemons that are no longer running."""
    swept = []
    for entry in os.listdir(SHM_DIR):
        match = _NAME.match(entry)
        if match and not pid_alive(int(match.group(1))):
            try:
                os.unlink(os.path.join(SHM_DIR, entry))
                swept.append(entry)
            except FileNotFoundError:
                pass
            except OSError as err:  # another user's, in sticky /dev/shm: not ours to remove
                log.warning("cannot remove orphaned shared memory %s: %s", entry, err)
    if swept:
        log.warning("removed %d shared-memory segment(s) left by a dead daemon", len(swept))
    return swept


class Memory(MemoryBackend):
    name = "host"

    def __init__(self) -> None:
        if not os.path.isdir(SHM_DIR):
            raise BackendUnavailable(f"{SHM_DIR} is missing: the host backend needs POSIX shared memory")
        self._serial = itertools.count()
        self.share_gid: int | None = None  # the socket group
        sweep_orphans()

    def devices(self) -> list[dict]:
        stat = os.statvfs(SHM_DIR)
        return [
            {
                "index": 0,
                "uuid": DEVICE,
                "pci_bus_id": None,
                "name": f"POSIX shared memory ({SHM_DIR})",
                "total_bytes": stat.f_blocks * stat.f_frsize,
                "footprint_bytes": 0,
            }
        ]

    def allocate(self, nbytes: int, device: str, flags: int, uid: int | None) -> Allocation:
        if device != DEVICE:
            raise self.unknown_device(device)
        size = round_up(nbytes, mmap.PAGESIZE)
        name = f"{PREFIX}{os.getpid()}-{next(self._serial)}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            self._share(fd, uid)
            os.posix_fallocate(fd, 0, size)  # zero-filled, and really reserved: no SIGBUS on first touch
        except OSError as err:
            os.unlink(path)
            raise ProtocolError(
                ErrorCode.ALLOCATION_FAILED, f"cannot prepare shared memory {name} of {size} bytes: {err}"
            ) from None
        finally:
            os.close(fd)
        return Allocation(self.name, name.encode(), size, DEVICE, token=path)

    def share_with_group(self, gid: int | None) -> None:
        self.share_gid = gid

    def _share(self, fd: int, uid: int | None) -> None:
        """Let the group's user, and nobody else where possible, open the segment.

        A root daemon gives the segment to that user (mode 0600), and may still
        unlink it from sticky /dev/shm later. A daemon running as its own user
        can do neither, so it shares the segment with its socket group (0660):
        any member may then open it, which is as far as file permissions go.
        """
        if uid is None or uid == os.geteuid():
            return
        if os.geteuid() == 0:
            os.fchown(fd, uid, -1)
        elif self.share_gid is not None:
            os.fchown(fd, -1, self.share_gid)
            os.fchmod(fd, 0o660)
        else:
            raise OSError(
                errno.EPERM,
                f"uid {uid} could not open it: a daemon not running as root shares host-backend memory "
                "only through its --socket-group",
            )

    def free(self, allocation: Allocation) -> None:
        try:
            os.unlink(allocation.token)
        except FileNotFoundError:
            log.warning("shared memory %s was already gone", allocation.token)
        except PermissionError as err:
            log.error("cannot unlink shared memory %s: %s; remove it by hand", allocation.token, err)


# ---------------------------------------------------------------- the worker's half

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


class Mapper(MapperBase):
    def device_identity(self, index: int | None) -> str:
        return DEVICE

    def open(self, handle: bytes, size: int) -> int:
        name = handle.decode()
        if not _NAME.match(name):
            raise ValueError(f"not a peerd shared-memory handle: {name!r}")
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        try:
            address = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        finally:
            os.close(fd)
        if address in (None, _MAP_FAILED):
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of {name} ({size} bytes) failed: {os.strerror(err)}")
        return address

    def close(self, address: int, size: int) -> None:
        if _libc.munmap(address, size) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"munmap at {address:#x} failed: {os.strerror(err)}")
