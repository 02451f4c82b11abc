"""Memory backends: who allocates device memory and how a worker maps it.

Each backend has two halves behind one small interface. The daemon half
(``ChunkMemory``) is thin: it allocates and exports a chunk, zeroes a range
of it, frees it, and describes its devices; the daemon hands out buffers as
(chunk, offset) through ``ArenaMemory`` (peerd.backends.arenas, over the
pure allocator peerd.arena), the ``MemoryBackend`` the registry sees. The
client half (``Mapper``) names the worker's device and opens or closes a
chunk's handle in the worker's address space. Both halves of a backend live
in one module so that the handle format is defined in one place. Where a
handle alone cannot open memory (host memfds), the daemon passes the memory
itself as fds over its fd channel (peerd.fdchannel), to members only.

A backend returns each buffer as an ``Allocation`` (peerd.backends.allocation,
re-exported here), a plain record: importing this package for a mapper loads
nothing of the daemon's registry.

Backends import their GPU libraries only when chosen: the daemon never
imports torch, and a host-only machine needs neither cuda-bindings nor
hip-python.
"""

from __future__ import annotations

import importlib
import logging
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Sequence

from ..sizes import human
from .allocation import Allocation

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from ..fdroom import FdRoom
    from .arenas import ArenaSettings

BACKENDS = ("host", "cuda", "hip")

class AllocationFailed(Exception):
    """A backend could not give the memory; its message is what the worker reads.

    Backends speak no protocol: the daemon's allocate turns these into error codes, in one place.
    """


class OutOfDeviceMemory(AllocationFailed):
    """The device cannot hold the buffer."""


class UnknownDevice(Exception):
    """The daemon serves no device of the identity asked for."""


def out_of_memory(size: int, device: str, error: str, free: int) -> OutOfDeviceMemory:
    """The refusal a worker sees when a device cannot hold its buffer."""
    return OutOfDeviceMemory(
        f"cannot allocate {size} bytes ({human(size)}) on {device}: {error}; "
        f"{free} bytes ({human(free)}) are free there"
    )


class BackendUnavailable(RuntimeError):
    """The backend's library or device cannot be used on this machine."""


class MemoryBackend(ABC):
    """What the registry allocates buffers from: ``ArenaMemory`` over a backend's ``ChunkMemory``."""

    name: str

    @abstractmethod
    def devices(self) -> list[dict[str, Any]]:
        """Each device served: identity, name, memory, the daemon's footprint."""

    @abstractmethod
    def allocate(self, nbytes: int, device: str, flags: int, uid: int | None) -> Allocation:
        """A zero-filled buffer of at least nbytes for processes of ``uid``; AllocationFailed or UnknownDevice when impossible."""

    @abstractmethod
    def footprint(self, nbytes: int) -> int:
        """The bytes a buffer of ``nbytes`` takes (its allocation's size): what the byte quotas count, checked
        before anything is allocated."""

    #: readable when memory that was not ``ready`` may be now (then ask ``woken`` which); None: always ready
    ready_fd: int | None = None

    def woken(self) -> list[bytes]:
        """Drain ``ready_fd``: the handles of the chunks whose memory may be ready now (ask ``ready`` again
        for the buffers in them)."""
        return []

    def ready(self, allocation: Allocation) -> bool:
        """Whether the buffer's memory may be handed out yet (a backend may still reserve it off the
        daemon's loop); AllocationFailed where it could not be had after all."""
        return True

    @abstractmethod
    def free(self, allocation: Allocation, mapped_by: Sequence[int] = ()) -> None:
        """Give the memory back; called once, after every rank released it, or an eviction took it from
        the live processes ``mapped_by``, which may still map it: none of it goes to the driver under them."""

    @abstractmethod
    def fd(self, allocation: Allocation) -> int | None:
        """The fd a member receives for this allocation's chunk over the fd channel; None where the handle suffices."""

    @abstractmethod
    def usage(self) -> list[dict[str, Any]]:
        """Reserved vs handed-out bytes by (device, uid), for the metrics (safe from any thread)."""

    @abstractmethod
    def handed(self, allocations: list[Allocation], pids: list[int]) -> None:
        """These processes were handed these buffers (a set's handles went out): they may map them until they exit."""

    @abstractmethod
    def process_gone(self, pid: int) -> None:
        """A client process exited, and its mappings with it."""

    @abstractmethod
    def trim(self) -> None:
        """Give every chunk no buffer uses back to the driver now (after an eviction)."""

    @abstractmethod
    def share_fd_room(self, room: FdRoom) -> None:
        """Count the fds the backend keeps open in the daemon's room (peerd.fdroom) from now on."""

    def stopping(self) -> None:
        """Shutdown begins: memory freed from now on is left as it is (nothing zeroes or punches it), for
        the processes still mapping it, whose kernels may still run."""

    @abstractmethod
    def close(self) -> None:
        """Release what the backend holds, at shutdown."""


class ChunkMemory(ABC):
    """A backend's daemon half: chunks of device memory, each exported once (peerd.arena.ChunkSource)."""

    name: str
    #: a driver free under another process's IPC mapping is undefined (peerd.arena: Note [No free under a mapping])
    free_needs_unmapped = True
    #: ``ready`` tells by range when a freed range's zeroing is done (peerd.arena.ChunkSource)
    ready_per_range = False

    @abstractmethod
    def devices(self) -> list[dict[str, Any]]:
        """Each device served: identity, name, memory, the daemon's footprint."""

    @abstractmethod
    def allocate_chunk(self, nbytes: int, device: str, flags: int, uid: int | None = None) -> tuple[bytes, Any]:
        """A zero-filled chunk of nbytes for processes of ``uid``: (its exported handle, a token for the
        calls below); AllocationFailed or UnknownDevice when impossible."""

    @abstractmethod
    def zero(self, token: Any, offset: int, nbytes: int) -> None:
        """Start zeroing a range of a chunk; ``sync`` waits for it."""

    #: readable when a chunk that was not ``ready`` may be now; None where every chunk is ready at once
    ready_fd: int | None = None

    def woken(self) -> list[bytes]:
        """Drain ``ready_fd``: the handles of the chunks that may be ``ready`` now."""
        return []

    def ready(self, token: Any, span: tuple[int, int] | None = None) -> bool:
        """Whether a chunk (or its range ``span``, where ``ready_per_range``) may be handed out yet (it may
        still be reserved or zeroed off the loop); AllocationFailed where it could not be had after all."""
        return True

    def share_fd_room(self, room: FdRoom) -> None:
        """Take a place in the daemon's fd room (peerd.fdroom) for each fd the backend keeps open; nothing
        where it keeps none."""

    def sync(self, token: Any) -> None:
        """Wait for the zeroing started on a chunk (nothing where ``zero`` is synchronous)."""

    @abstractmethod
    def free_chunk(self, token: Any) -> None:
        """Give a chunk back to the driver, after or instead of the zeroing started on it."""

    def chunk_fd(self, token: Any) -> int | None:
        """The fd a member receives for a chunk over the fd channel; None where the handle suffices."""
        return None

    def stopping(self) -> None:
        """Shutdown begins (MemoryBackend.stopping)."""

    def close(self) -> None:
        """Release what the backend itself holds (contexts), at shutdown."""

    def unknown_device(self, device: str) -> UnknownDevice:
        served = ", ".join(d["uuid"] for d in self.devices()) or "none"
        return UnknownDevice(
            f"this daemon ({self.name} backend) serves no device {device!r}; it serves: {served}"
        )


class Mapper(ABC):
    """The worker's half: maps handles into the calling process."""

    #: whether members fetch the memory as fds over the fd channel, beside the handles
    passes_fds = False

    @abstractmethod
    def device_identity(self, index: int | None) -> str:
        """The identity (UUID) of the worker's device ``index`` (None: current)."""

    @abstractmethod
    def open(self, handle: bytes, size: int, fd: int | None = None) -> int:
        """Map a chunk's handle (from ``fd`` where the backend passes fds); the address of its first byte here."""

    @abstractmethod
    def close(self, address: int, size: int) -> None:
        """Undo open()."""


def _module(name: str):
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return importlib.import_module(f"{__name__}.{name}")


def chunk_memory(name: str) -> ChunkMemory:
    """The daemon half of backend ``name``, or "auto": cuda, else hip, else host, saying why each GPU
    backend was passed over (a GPU node without cuda-bindings would otherwise serve host memory unseen)."""
    if name != "auto":
        return _module(name).Memory()
    passed_over = []
    for candidate in ("cuda", "hip"):
        try:
            return _module(candidate).Memory()
        except BackendUnavailable as err:
            passed_over.append(f"{candidate}: {err}")
    log.info("--backend auto serves host memory; passed over %s (--backend cuda or hip fails instead)",
             "; ".join(passed_over))
    return _module("host").Memory()


def memory_backend(name: str, arena: ArenaSettings | None = None) -> MemoryBackend:
    """What the daemon allocates from: arenas over backend ``name`` (see ``chunk_memory``)."""
    from .arenas import ArenaMemory, ArenaSettings

    return ArenaMemory(chunk_memory(name), arena or ArenaSettings())


def mapper(name: str) -> Mapper:
    """The client half of backend ``name``."""
    return _module(name).Mapper()
