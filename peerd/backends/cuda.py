"""CUDA backend: cudaMalloc + cudaIpcGetMemHandle, through cuda-bindings.

The daemon's half is thin: it allocates, exports and frees arena chunks
(peerd.arena hands out the buffers in them) and zeroes freed ranges with
cudaMemsetAsync on a stream of its own per device, made on first use (so the
start-up footprint below is unchanged), which the arena synchronises before
a range goes out again. The handle is the 64 bytes of a chunk's
``cudaIpcMemHandle_t``. Device identity is
the GPU's UUID in the form ``nvidia-smi -L`` prints ("GPU-8-4-4-4-12" hex),
never an ordinal: the daemon and each worker can see different
``CUDA_VISIBLE_DEVICES``, so ordinals are translated at each end.

The daemon holds one primary context per GPU, created at start-up so that it
is ready when it says so, and keeps it small: a context reserves local memory
for every thread the GPU can hold at the per-thread stack limit (1 KiB by
default: 264 MiB of an H200's 527 MiB context). The daemon's only kernels are
cudaMemset's, which need no stack, so the limit is set to 0 (measured on an
H200: 263 MiB instead of 527); the driver raises it by itself for any kernel
that needs more.

NVIDIA has no uncached device allocation: buffers are plain device memory
that peers access with system-scope operations, so ``FLAG_FINE_GRAINED``
changes nothing here.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

from . import Mapper as MapperBase
from . import AllocationFailed, BackendUnavailable, ChunkMemory, out_of_memory

log = logging.getLogger("peerd.backends.cuda")

HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
STACK_BYTES = 0  # per-thread stack limit set on the daemon's contexts
#: the device malloc heap (8 MiB) and printf FIFO (1 MiB) serve kernels' malloc and printf
SMALL_LIMITS = (("cudaLimitMallocHeapSize", 0), ("cudaLimitPrintfFifoSize", 4096))



def _load():
    """The cuda-bindings runtime module, or BackendUnavailable saying why not."""
    try:
        from cuda.bindings import runtime as cudart  # cuda-bindings >= 12.6
    except ImportError:
        try:
            from cuda import cudart  # older cuda-python
        except ImportError as err:
            raise BackendUnavailable(
                f"cuda-bindings is not importable ({err}); install it with `pip install cuda-bindings`"
            ) from None
    return cudart


class CudaError(RuntimeError):
    """A CUDA runtime call failed; ``name`` is the error's name (cudaErrorMemoryAllocation, …)."""

    def __init__(self, name: str, what: str):
        super().__init__(f"{what} failed: {name}")
        self.name = name


def _check(cudart, result: tuple, what: str) -> Any:
    """Unpack a cuda-bindings result tuple ``(error, *values)``; raise CudaError on failure."""
    err, *values = result
    if err != cudart.cudaError_t.cudaSuccess:
        _, name = cudart.cudaGetErrorName(err)
        raise CudaError(name.decode() if isinstance(name, bytes) else str(name), what)
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _text(value) -> str:
    """A C string from cuda-bindings or NVML: bytes up to the first NUL (padding follows it), or str."""
    return value.split(b"\0", 1)[0].decode(errors="replace") if isinstance(value, bytes) else str(value)


def _properties(cudart, ordinal: int):
    return _check(cudart, cudart.cudaGetDeviceProperties(ordinal), f"cudaGetDeviceProperties({ordinal})")


def _uuid(prop) -> str:
    """The UUID in ``prop``, read from the struct's memory: 16 raw bytes, NULs included."""
    h = ctypes.string_at(prop.uuid.getPtr(), 16).hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _nvml_used() -> dict[str, int]:
    """Used memory of every GPU NVML sees, by UUID; empty where nvidia-ml-py or NVML is missing."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as err:  # ImportError, or NVMLError when the library is absent
        log.info("NVML unavailable (%s): device footprints will be reported as unknown", err)
        return {}
    try:
        used = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            used[_text(pynvml.nvmlDeviceGetUUID(handle))] = pynvml.nvmlDeviceGetMemoryInfo(handle).used
        return used
    except pynvml.NVMLError as err:
        log.info("NVML cannot read device memory (%s): device footprints will be reported as unknown", err)
        return {}
    finally:
        pynvml.nvmlShutdown()


class Memory(ChunkMemory):
    """The daemon's half: one small primary context per GPU it can see.

    ``footprint_bytes`` is what the daemon's start-up cost on the device,
    measured once as the change in the device's used memory that NVML
    (nvidia-ml-py) reports between before the first CUDA call and after
    every context is made small. The driver cannot be asked before a
    context exists (cudaMemGetInfo needs one; even cudaGetDeviceProperties
    already costs 3 MiB on an H200), and NVML's per-process accounting
    misses the daemon when it runs in a PID namespace (a container) and
    leaves out ~9 MiB the driver spends for the process, so the
    before/after difference is the one number that is right everywhere. It
    is off only if another process allocates on that GPU during start-up.
    Without NVML it is None: unknown, never a guess. Buffers the daemon
    allocates later are not in it.
    """

    name = "cuda"

    def __init__(self) -> None:
        self._rt = cudart = _load()
        before = _nvml_used()
        try:
            count = _check(cudart, cudart.cudaGetDeviceCount(), "cudaGetDeviceCount")
        except CudaError as err:
            raise BackendUnavailable(f"no usable CUDA device: {err}") from None
        self._devices: list[dict[str, Any]] = []
        for ordinal in range(count):
            try:
                self._devices.append(self._start(ordinal))
            except CudaError as err:
                log.warning("CUDA device %d is not usable, skipping it: %s", ordinal, err)
        if not self._devices:
            raise BackendUnavailable(f"none of the {count} CUDA device(s) could be initialised (see the log)")
        after = _nvml_used() if before else {}
        for d in self._devices:
            if d["uuid"] in before and d["uuid"] in after:
                d["footprint_bytes"] = after[d["uuid"]] - before[d["uuid"]]
        self._ordinal = {d["uuid"]: d["index"] for d in self._devices}
        self._streams: dict[int, Any] = {}  # ordinal -> the daemon's zeroing stream, made on first use

    def _start(self, ordinal: int) -> dict[str, Any]:
        """Create device ``ordinal``'s context with a small stack; describe the device."""
        cudart = self._rt
        prop = _properties(cudart, ordinal)
        uuid = _uuid(prop)
        _check(cudart, cudart.cudaSetDevice(ordinal), f"cudaSetDevice({ordinal})")
        _check(cudart, cudart.cudaFree(0), f"creating the context of device {ordinal}")
        _check(
            cudart,
            cudart.cudaDeviceSetLimit(cudart.cudaLimit.cudaLimitStackSize, STACK_BYTES),
            f"cudaDeviceSetLimit(cudaLimitStackSize, {STACK_BYTES}) on device {ordinal}",
        )
        for limit, value in SMALL_LIMITS:  # reservations no memset uses; worth a few MiB, not a failure
            try:
                _check(cudart, cudart.cudaDeviceSetLimit(getattr(cudart.cudaLimit, limit), value), limit)
            except CudaError as err:
                log.warning("device %d: could not shrink %s: %s", ordinal, limit, err)
        _check(cudart, cudart.cudaDeviceSynchronize(), f"cudaDeviceSynchronize on device {ordinal}")
        bus_id = _check(cudart, cudart.cudaDeviceGetPCIBusId(32, ordinal), f"cudaDeviceGetPCIBusId({ordinal})")
        device = {
            "index": ordinal,
            "uuid": uuid,
            "pci_bus_id": _text(bus_id),
            "name": _text(prop.name),
            "total_bytes": int(prop.totalGlobalMem),
            "footprint_bytes": None,  # measured once every device is up
        }
        log.info("serving CUDA device %d: %s %s (%s)", ordinal, device["name"], uuid, device["pci_bus_id"])
        return device

    def devices(self) -> list[dict]:
        """Each device, checked now: one that fails cudaMemGetInfo is reported with its error."""
        cudart = self._rt
        described = []
        for d in self._devices:
            d = dict(d)
            try:
                _check(cudart, cudart.cudaSetDevice(d["index"]), f"cudaSetDevice({d['index']})")
                d["free_bytes"] = int(_check(cudart, cudart.cudaMemGetInfo(), "cudaMemGetInfo")[0])
            except CudaError as err:
                d["error"] = str(err)
            described.append(d)
        return described

    def allocate_chunk(self, nbytes: int, device: str, flags: int, uid: int | None = None) -> tuple[bytes, tuple[int, int]]:
        ordinal = self._ordinal.get(device)
        if ordinal is None:
            raise self.unknown_device(device)
        cudart = self._rt
        _check(cudart, cudart.cudaSetDevice(ordinal), f"cudaSetDevice({ordinal})")
        try:
            pointer = _check(cudart, cudart.cudaMalloc(nbytes), f"cudaMalloc({nbytes})")
        except CudaError as err:
            cudart.cudaGetLastError()  # clear it: an allocation failure must not leak into the next call
            free, _ = _check(cudart, cudart.cudaMemGetInfo(), "cudaMemGetInfo")
            raise out_of_memory(nbytes, device, err.name, free) from None
        try:
            _check(cudart, cudart.cudaMemset(pointer, 0, nbytes), "cudaMemset")
            _check(cudart, cudart.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
            handle = _check(cudart, cudart.cudaIpcGetMemHandle(pointer), "cudaIpcGetMemHandle")
        except CudaError as err:
            cudart.cudaFree(pointer)
            raise AllocationFailed(f"cannot export {nbytes} bytes on {device}: {err}") from None
        return ctypes.string_at(handle.getPtr(), HANDLE_BYTES), (ordinal, int(pointer))

    def _stream(self, ordinal: int):
        """Device ``ordinal``'s zeroing stream (current device set by the caller)."""
        stream = self._streams.get(ordinal)
        if stream is None:
            cudart = self._rt
            stream = self._streams[ordinal] = _check(
                cudart, cudart.cudaStreamCreateWithFlags(cudart.cudaStreamNonBlocking), "cudaStreamCreateWithFlags"
            )
        return stream

    def zero(self, token: tuple[int, int], offset: int, nbytes: int) -> None:
        ordinal, pointer = token
        cudart = self._rt
        _check(cudart, cudart.cudaSetDevice(ordinal), f"cudaSetDevice({ordinal})")
        _check(cudart, cudart.cudaMemsetAsync(pointer + offset, 0, nbytes, self._stream(ordinal)), "cudaMemsetAsync")

    def sync(self, token: tuple[int, int]) -> None:
        ordinal, _ = token
        _check(self._rt, self._rt.cudaSetDevice(ordinal), f"cudaSetDevice({ordinal})")
        self._drain(ordinal)

    def _drain(self, ordinal: int) -> None:
        """Wait for device ``ordinal``'s zeroing stream, where it has one (current device set by the caller)."""
        if ordinal in self._streams:
            _check(self._rt, self._rt.cudaStreamSynchronize(self._streams[ordinal]), "cudaStreamSynchronize")

    def free_chunk(self, token: tuple[int, int]) -> None:
        ordinal, pointer = token
        cudart = self._rt
        _check(cudart, cudart.cudaSetDevice(ordinal), f"cudaSetDevice({ordinal})")
        self._drain(ordinal)  # no zeroing may run into memory the driver hands on
        _check(cudart, cudart.cudaFree(pointer), f"cudaFree on device {ordinal}")

    def close(self) -> None:
        """Nothing: process exit tears the contexts down.

        cudaDeviceReset would free every buffer at once, including ones that
        a live worker still maps (and frees must stay the groups' decision),
        and it resets the context of whatever else in the process uses it.
        """


# ---------------------------------------------------------------- the worker's half

#: ordinal -> UUID, for this process's life (its visible devices are fixed once CUDA starts): every
#: PeerBuffer names its device in its join, and cudaGetDeviceProperties, the one call that tells the
#: UUID, reads every property of the device
_identities: dict[int, str] = {}


class Mapper(MapperBase):
    """The worker's half: opens handles in the calling thread's current device context.

    A second open of one handle in a process is refused or reference-counted,
    depending on the CUDA version: the client's cache opens each handle once.
    """

    def __init__(self) -> None:
        self._rt = _load()

    def device_identity(self, index: int | None) -> str:
        cudart = self._rt
        if index is None:
            index = _check(cudart, cudart.cudaGetDevice(), "cudaGetDevice")
        known = _identities.get(index)
        if known is None:
            known = _identities[index] = _uuid(_properties(cudart, index))
        return known

    def open(self, handle: bytes, size: int, fd: int | None = None) -> int:
        if len(handle) != HANDLE_BYTES:
            raise ValueError(f"a CUDA IPC handle is {HANDLE_BYTES} bytes, not {len(handle)}")
        cudart = self._rt
        ipc = cudart.cudaIpcMemHandle_t()
        ctypes.memmove(ipc.getPtr(), handle, HANDLE_BYTES)
        pointer = _check(
            cudart,
            cudart.cudaIpcOpenMemHandle(ipc, cudart.cudaIpcMemLazyEnablePeerAccess),
            "cudaIpcOpenMemHandle",
        )
        return int(pointer)

    def close(self, address: int, size: int) -> None:
        cudart = self._rt
        _check(cudart, cudart.cudaIpcCloseMemHandle(address), f"cudaIpcCloseMemHandle({address:#x})")
