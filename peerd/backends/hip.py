"""HIP backend: hipExtMallocWithFlags + hipIpcGetMemHandle, through hip-python.

NOT RUN ON AMD HARDWARE: see the last paragraph.

The daemon's half has the CUDA backend's structure: it allocates, exports
and frees arena chunks (peerd.arena hands out buffers as chunk handle plus
offset, as other ROCm engines share sub-buffers over hipIpc) and zeroes a
freed range with hipMemset, synchronously. The handle is the 64 bytes of a
chunk's ``hipIpcMemHandle_t``. Chunks are uncached
(``hipDeviceMallocUncached``, 0x3: hip-python has no constant for it), so a
peer's stores are seen without cache maintenance; ``FLAG_FINE_GRAINED`` asks
for fine-grained chunks (``hipDeviceMallocFinegrained``, 0x1) instead.

Device identity is the string ``rocminfo`` prints as the agent's Uuid,
"GPU-" followed by the ASCII unique ID that ROCm writes into ``hipUUID``
(e.g. GPU-e282895b62c2b295), which ``HIP_VISIBLE_DEVICES`` also accepts.
A GPU without a unique ID is named by its PCI bus id instead.

hip-python has one calling convention across its releases (checked against
6.2, 7.2 and 10.0): out-parameters come back in the result tuple after the
``hipError_t``. Releases up to 7.x install the module as ``hip.hip``; 10.x
installs ``rocm.bindings.hip`` and re-exports it as ``hip.hip``. Both load
libamdhip64.so at the first call and resolve each function by name.

What runs: tests/gpu/test_hip.py drives the whole backend, daemon and
worker halves, through hip-python's own bindings on an NVIDIA GPU, over a
libamdhip64.so that maps each HIP call to the CUDA driver (tests/hipshim/);
without a GPU, tests/integration/test_hip_bindings.py runs the load and
error paths. That checks the calls, their arguments, the struct layouts and
the error handling; it proves nothing about AMD's driver (uncached and
fine-grained semantics, XGMI peer access, ROCm versions): no AMD GPU has
run this code.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

from ..protocol import FLAG_FINE_GRAINED
from . import Mapper as MapperBase
from . import AllocationFailed, BackendUnavailable, ChunkMemory, out_of_memory

log = logging.getLogger("peerd.backends.hip")

HANDLE_BYTES = 64  # HIP_IPC_HANDLE_SIZE
UNCACHED = 0x3  # hipDeviceMallocUncached
FINE_GRAINED = 0x1  # hipDeviceMallocFinegrained
_TEXT = 256  # buffer for names and bus ids



class HipError(RuntimeError):
    """A HIP call failed; ``name`` is the error's name (hipErrorOutOfMemory, …)."""

    def __init__(self, name: str, what: str):
        super().__init__(f"{what} failed: {name}")
        self.name = name


def _check(result: tuple, what: str) -> Any:
    """Unpack a hip-python result tuple ``(hipError_t, *values)``; raise HipError on failure."""
    err, *values = result
    if err != 0:  # hipSuccess
        raise HipError(getattr(err, "name", str(err)), what)
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


class _Hip:
    """hip-python's runtime module, whichever layout is installed, behind one set of calls."""

    def __init__(self) -> None:
        try:
            try:
                from rocm.bindings import hip  # hip-python 10 and later
            except ImportError:
                from hip import hip  # hip-python up to 7.x
        except Exception as err:  # ImportError, or OSError/RuntimeError loading the library
            raise BackendUnavailable(
                f"hip-python / libamdhip64 could not be loaded ({err}); install ROCm and the "
                "hip-python wheel that matches its version"
            ) from None
        self.rt = hip
        try:
            self.count = _check(hip.hipGetDeviceCount(), "hipGetDeviceCount")
        except HipError as err:
            raise BackendUnavailable(f"no usable HIP device: {err}") from None
        except (OSError, RuntimeError) as err:  # hip-python resolves libamdhip64 symbols on first use
            raise BackendUnavailable(f"libamdhip64 could not be loaded through hip-python ({err})") from None

    def _text(self, fn, ordinal: int, what: str) -> str:
        """A C string a call fills in (name, bus id), given the buffer length it may use."""
        return ctypes.string_at(int(_check(fn(_TEXT, ordinal), what))).decode(errors="replace")

    def identity(self, ordinal: int) -> str:
        uuid = _check(self.rt.hipDeviceGetUuid(ordinal), f"hipDeviceGetUuid({ordinal})")
        raw = ctypes.string_at(int(uuid), 16)
        text = raw.rstrip(b"\0")
        if not text:  # no unique ID (rocminfo prints GPU-XX): the bus id is the only stable name
            return self.pci_bus_id(ordinal)
        if all(0x21 <= c < 0x7F for c in text):
            return f"GPU-{text.decode()}"
        return f"GPU-{raw.hex()}"

    def pci_bus_id(self, ordinal: int) -> str:
        return self._text(self.rt.hipDeviceGetPCIBusId, ordinal, f"hipDeviceGetPCIBusId({ordinal})")

    def name(self, ordinal: int) -> str:
        return self._text(self.rt.hipDeviceGetName, ordinal, f"hipDeviceGetName({ordinal})")

    def ipc_handle(self, pointer: int) -> bytes:
        handle = _check(self.rt.hipIpcGetMemHandle(pointer), "hipIpcGetMemHandle")
        return ctypes.string_at(int(handle), HANDLE_BYTES)


class Memory(ChunkMemory):
    """The daemon's half. ``footprint_bytes`` is None: not measured on AMD yet."""

    name = "hip"

    def __init__(self) -> None:
        self._hip = h = _Hip()
        self._devices: list[dict[str, Any]] = []
        for ordinal in range(h.count):
            try:
                self._devices.append(self._start(ordinal))
            except HipError as err:
                log.warning("HIP device %d is not usable, skipping it: %s", ordinal, err)
        if not self._devices:
            raise BackendUnavailable(f"none of the {h.count} HIP device(s) could be initialised (see the log)")
        self._ordinal = {d["uuid"]: d["index"] for d in self._devices}

    def _start(self, ordinal: int) -> dict[str, Any]:
        """Initialise device ``ordinal`` now, so the daemon is ready when it says so; describe it."""
        h, hip = self._hip, self._hip.rt
        _check(hip.hipSetDevice(ordinal), f"hipSetDevice({ordinal})")
        _check(hip.hipDeviceSynchronize(), f"hipDeviceSynchronize on device {ordinal}")
        device = {
            "index": ordinal,
            "uuid": h.identity(ordinal),
            "pci_bus_id": h.pci_bus_id(ordinal),
            "name": h.name(ordinal),
            "total_bytes": int(_check(hip.hipDeviceTotalMem(ordinal), f"hipDeviceTotalMem({ordinal})")),
            "footprint_bytes": None,
        }
        log.info("serving HIP device %d: %s %s (%s)", ordinal, device["name"], device["uuid"], device["pci_bus_id"])
        return device

    def devices(self) -> list[dict]:
        return [dict(d) for d in self._devices]

    def allocate_chunk(self, nbytes: int, device: str, flags: int, uid: int | None = None) -> tuple[bytes, tuple[int, int]]:
        ordinal = self._ordinal.get(device)
        if ordinal is None:
            raise self.unknown_device(device)
        hip = self._hip.rt
        kind = FINE_GRAINED if flags & FLAG_FINE_GRAINED else UNCACHED
        _check(hip.hipSetDevice(ordinal), f"hipSetDevice({ordinal})")
        try:
            pointer = int(_check(hip.hipExtMallocWithFlags(nbytes, kind), f"hipExtMallocWithFlags({nbytes}, {kind:#x})"))
        except HipError as err:
            hip.hipGetLastError()  # clear it: an allocation failure must not leak into the next call
            free, _ = _check(hip.hipMemGetInfo(), "hipMemGetInfo")
            raise out_of_memory(nbytes, device, err.name, free) from None
        try:
            _check(hip.hipMemset(pointer, 0, nbytes), "hipMemset")
            _check(hip.hipDeviceSynchronize(), "hipDeviceSynchronize")
            handle = self._hip.ipc_handle(pointer)
        except HipError as err:
            hip.hipFree(pointer)
            raise AllocationFailed(f"cannot export {nbytes} bytes on {device}: {err}") from None
        return handle, (ordinal, pointer)

    def zero(self, token: tuple[int, int], offset: int, nbytes: int) -> None:
        ordinal, pointer = token
        hip = self._hip.rt
        _check(hip.hipSetDevice(ordinal), f"hipSetDevice({ordinal})")
        _check(hip.hipMemset(pointer + offset, 0, nbytes), "hipMemset")
        _check(hip.hipDeviceSynchronize(), "hipDeviceSynchronize")

    def free_chunk(self, token: tuple[int, int]) -> None:
        ordinal, pointer = token
        hip = self._hip.rt
        _check(hip.hipSetDevice(ordinal), f"hipSetDevice({ordinal})")
        _check(hip.hipFree(pointer), f"hipFree on device {ordinal}")

    def close(self) -> None:
        """Nothing: process exit releases the devices; hipDeviceReset would free buffers still mapped."""


# ---------------------------------------------------------------- the worker's half


class Mapper(MapperBase):
    """The worker's half: opens handles on the calling thread's current device."""

    def __init__(self) -> None:
        self._hip = _Hip()

    def device_identity(self, index: int | None) -> str:
        hip = self._hip.rt
        if index is None:
            index = _check(hip.hipGetDevice(), "hipGetDevice")
        return self._hip.identity(index)

    def open(self, handle: bytes, size: int, fd: int | None = None) -> int:
        if len(handle) != HANDLE_BYTES:
            raise ValueError(f"a HIP IPC handle is {HANDLE_BYTES} bytes, not {len(handle)}")
        hip = self._hip.rt
        # hip-python accepts any buffer where a struct is passed by value: it copies the 64 bytes.
        pointer = _check(
            hip.hipIpcOpenMemHandle(bytearray(handle), hip.hipIpcMemLazyEnablePeerAccess), "hipIpcOpenMemHandle"
        )
        return int(pointer)

    def close(self, address: int, size: int) -> None:
        _check(self._hip.rt.hipIpcCloseMemHandle(address), f"hipIpcCloseMemHandle({address:#x})")
