"""Smoke test of the CUDA backend on a real GPU: allocate, export, open in other processes.

    PYTHONUNBUFFERED=1 python3 tests/gpu/smoke_cuda_backend.py

Needs an NVIDIA GPU and cuda-bindings (nvidia-ml-py for the footprint lines);
no pyzmq, no daemon. The parent plays the daemon (peerd.backends.cuda.Memory);
each worker is a fresh process started with a different CUDA_VISIBLE_DEVICES
(unset, an index, the GPU's UUID) that must find the device by UUID, map the
handle with Mapper, see zeros, and leave a pattern the parent reads back
through its own pointer. Prints one PASS/FAIL line per check, exits 1 on any
FAIL.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from peerd.arena import ALIGNMENT  # noqa: E402
from peerd.backends import cuda as backend  # noqa: E402
from peerd.backends import OutOfDeviceMemory, UnknownDevice  # noqa: E402
from peerd.protocol import FLAG_FINE_GRAINED  # noqa: E402

MiB = 1 << 20
failures = 0


def report(ok: bool, what: str, detail: str = "") -> bool:
    global failures
    failures += not ok
    print(f"{'PASS' if ok else 'FAIL'} {what}{': ' + detail if detail else ''}", flush=True)
    return ok


def check(result, what):
    return backend._check(rt(), result, what)


def rt():
    return backend._load()


def read(pointer: int, n: int = 16) -> bytes:
    cudart = rt()
    buf = ctypes.create_string_buffer(n)
    check(cudart.cudaMemcpy(ctypes.addressof(buf), pointer, n, cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost), "D2H")
    return buf.raw


def write(pointer: int, data: bytes) -> None:
    cudart = rt()
    buf = ctypes.create_string_buffer(data, len(data))
    check(
        cudart.cudaMemcpy(pointer, ctypes.addressof(buf), len(data), cudart.cudaMemcpyKind.cudaMemcpyHostToDevice),
        "H2D",
    )
    check(cudart.cudaDeviceSynchronize(), "sync")


def spawn(args: list[str], visible: str | None) -> subprocess.CompletedProcess:
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True, text=True, timeout=120)


# ---------------------------------------------------------------- child modes


def worker(handle_hex: str, size: int, uuid: str, pattern_hex: str) -> None:
    """A worker: find the device by UUID, map, check zeros, write the pattern at both ends."""
    cudart = rt()
    mapper = backend.Mapper()
    count = check(cudart.cudaGetDeviceCount(), "cudaGetDeviceCount")
    matches = [i for i in range(count) if mapper.device_identity(i) == uuid]
    print(f"worker: CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r} sees {count} device(s), "
          f"{uuid} is ordinal {matches}")
    assert len(matches) == 1, "the device was not found by UUID"
    check(cudart.cudaSetDevice(matches[0]), "cudaSetDevice")
    assert mapper.device_identity(None) == uuid, "device_identity(None) disagrees after cudaSetDevice"
    address = mapper.open(bytes.fromhex(handle_hex), size)
    head, tail = read(address), read(address + size - 16)
    assert head == tail == bytes(16), f"not zero-filled: head={head.hex()} tail={tail.hex()}"
    pattern = bytes.fromhex(pattern_hex)
    write(address, pattern)
    write(address + size - 16, pattern)
    mapper.close(address, size)
    print("worker: OK")


def daemon_under(uuid: str) -> None:
    """The daemon half started under a CUDA_VISIBLE_DEVICES that renumbers: it still serves ``uuid``."""
    memory = backend.Memory()
    served = [d["uuid"] for d in memory.devices()]
    assert uuid in served, f"{uuid} not in {served}"
    _, token = memory.allocate_chunk(ALIGNMENT, uuid, 0)
    memory.free_chunk(token)
    print(f"daemon: OK, serves {served}")


def footprint(stack: str) -> None:
    """Device memory used, per NVML, at each step of creating one context (``stack``: limit or 'default')."""
    import pynvml

    cudart = rt()
    pynvml.nvmlInit()
    nvml = pynvml.nvmlDeviceGetHandleByIndex(0)

    def used():
        return pynvml.nvmlDeviceGetMemoryInfo(nvml).used

    steps = {"start": used()}
    check(cudart.cudaGetDeviceProperties(0), "cudaGetDeviceProperties")
    steps["after cudaGetDeviceProperties"] = used()
    check(cudart.cudaSetDevice(0), "cudaSetDevice")
    check(cudart.cudaFree(0), "cudaFree(0)")
    check(cudart.cudaDeviceSynchronize(), "sync")
    steps["after context"] = used()
    if stack != "default":
        check(cudart.cudaDeviceSetLimit(cudart.cudaLimit.cudaLimitStackSize, int(stack)), "cudaDeviceSetLimit")
        check(cudart.cudaDeviceSynchronize(), "sync")
        steps["after stack limit"] = used()
    pointer = check(cudart.cudaMalloc(2 * MiB), "cudaMalloc")
    check(cudart.cudaMemset(pointer, 0, 2 * MiB), "cudaMemset")
    check(cudart.cudaDeviceSynchronize(), "sync")
    check(cudart.cudaFree(pointer), "cudaFree")
    check(cudart.cudaDeviceSynchronize(), "sync")
    steps["after a cudaMemset (buffer freed)"] = used()
    limit = check(cudart.cudaDeviceGetLimit(cudart.cudaLimit.cudaLimitStackSize), "cudaDeviceGetLimit")
    own = [p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(nvml) if p.pid == os.getpid()]
    print(json.dumps({"stack": stack, "stack_limit_now": limit, "used": steps, "nvml_per_process": own}))


# ---------------------------------------------------------------- the parent


def api_facts() -> None:
    """What this machine's cuda-bindings looks like: names and shapes the backend relies on."""
    from importlib.metadata import PackageNotFoundError, version

    cudart = rt()
    for dist in ("cuda-bindings", "cuda-python", "nvidia-ml-py"):
        try:
            print(f"info: {dist} {version(dist)}")
        except PackageNotFoundError:
            print(f"info: {dist} not installed")
    print(f"info: runtime module {cudart.__name__}")
    print(f"info: cudaDriverGetVersion -> {cudart.cudaDriverGetVersion()}")
    print(f"info: cudaRuntimeGetVersion -> {cudart.cudaRuntimeGetVersion()}")
    print(f"info: cudaGetErrorName(cudaErrorMemoryAllocation) -> "
          f"{cudart.cudaGetErrorName(cudart.cudaError_t.cudaErrorMemoryAllocation)}")
    print(f"info: cudaIpcMemLazyEnablePeerAccess = {cudart.cudaIpcMemLazyEnablePeerAccess!r}")
    handle = cudart.cudaIpcMemHandle_t()
    reserved = getattr(handle, "reserved", None)
    print(f"info: cudaIpcMemHandle_t has getPtr: {hasattr(handle, 'getPtr')}, "
          f"reserved: {type(reserved).__name__} of length {len(reserved) if reserved is not None else '-'}")
    print(f"info: cudaDeviceGetPCIBusId(32, 0) -> {cudart.cudaDeviceGetPCIBusId(32, 0)}")
    prop = check(cudart.cudaGetDeviceProperties(0), "cudaGetDeviceProperties")
    print(f"info: prop.name -> {prop.name!r}; prop.uuid.bytes -> {prop.uuid.bytes!r}")
    smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    print(f"info: nvidia-smi -L -> {smi.stdout.strip()}")


def footprints() -> dict[str, int]:
    """Context cost per stack limit, each in a fresh process; returns bytes by limit."""
    cost = {}
    for stack in ("default", "1024", "256", "64", "0"):
        child = spawn(["footprint", stack], visible=None)
        if not report(child.returncode == 0, f"footprint probe, stack {stack}", child.stderr.strip()[-400:]):
            continue
        data = json.loads(child.stdout.strip().splitlines()[-1])
        steps = data["used"]
        base = steps["start"]
        deltas = ", ".join(f"{k} +{(v - base) / MiB:.0f} MiB" for k, v in steps.items() if k != "start")
        own = [f"{b / MiB:.0f} MiB" for b in data["nvml_per_process"]]
        print(f"footprint: stack {stack} (limit now {data['stack_limit_now']}): {deltas}; NVML per-process {own}")
        cost[stack] = list(steps.values())[-1] - base
    return cost


def parent() -> None:
    cudart = rt()
    cost = {}
    try:
        cost = footprints()  # first: each probe is a fresh process, measured while nothing else changes
    except Exception:
        report(False, "footprint probes", traceback.format_exc())
    try:
        memory = backend.Memory()
    except Exception:
        report(False, "Memory() starts", traceback.format_exc())
        api_facts()
        sys.exit(1)
    try:
        api_facts()  # after Memory(): these calls would otherwise create the context it measures
    except Exception:
        report(False, "cuda-bindings API facts", traceback.format_exc())
    devices = memory.devices()
    print("devices: " + json.dumps(devices, indent=1))
    uuid = devices[0]["uuid"]
    smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    report(uuid in smi, "UUID has nvidia-smi -L's form", uuid)
    bus_id = devices[0]["pci_bus_id"]
    report(re.fullmatch(r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]", bus_id) is not None,
           "PCI bus id is clean", repr(bus_id))
    footprint = devices[0]["footprint_bytes"]
    report(isinstance(footprint, int), "footprint measured",
           f"{(footprint or 0) / MiB:.0f} MiB with a {backend.STACK_BYTES}-byte stack limit")
    if "default" in cost and isinstance(footprint, int):
        report(footprint < 0.6 * cost["default"], "the small stack limit about halves the context",
               f"{footprint / MiB:.0f} MiB against {cost['default'] / MiB:.0f} MiB for a default context")
    limit = check(cudart.cudaDeviceGetLimit(cudart.cudaLimit.cudaLimitStackSize), "cudaDeviceGetLimit")
    report(limit == backend.STACK_BYTES, "the daemon's context has the small stack limit", f"{limit} bytes")

    size = 4 * MiB
    handle, token = memory.allocate_chunk(size, uuid, 0)
    report(len(handle) == 64 and handle != bytes(64), "handle is 64 non-zero bytes")
    ordinal, pointer = token
    report(read(pointer) == bytes(16) and read(pointer + size - 16) == bytes(16), "parent sees zeros")

    for label, visible in (("unset", None), ("0", "0"), ("the UUID", uuid)):
        pattern = os.urandom(16)
        child = spawn(["worker", handle.hex(), str(size), uuid, pattern.hex()], visible)
        out = (child.stdout + child.stderr).strip()
        ok = child.returncode == 0 and "worker: OK" in child.stdout
        report(ok, f"worker with CUDA_VISIBLE_DEVICES={label} found the GPU by UUID, saw zeros, wrote", out[-600:])
        check(cudart.cudaSetDevice(ordinal), "cudaSetDevice")
        head, tail = read(pointer), read(pointer + size - 16)
        report(head == pattern and tail == pattern, f"parent reads the pattern of the worker ({label})",
               f"head {head.hex()} tail {tail.hex()} want {pattern.hex()}")
        check(cudart.cudaMemset(pointer, 0, size), "cudaMemset")
        check(cudart.cudaDeviceSynchronize(), "sync")

    check(cudart.cudaMemset(pointer + MiB - 16, 0xCD, 8192 + 32), "cudaMemset")  # a range and its neighbours
    check(cudart.cudaDeviceSynchronize(), "sync")
    memory.zero(token, MiB, 8192)
    memory.sync(token)
    check(cudart.cudaSetDevice(ordinal), "cudaSetDevice")
    inside, before, after = read(pointer + MiB), read(pointer + MiB - 16), read(pointer + MiB + 8192)
    report(inside == bytes(16) and read(pointer + MiB + 8192 - 16) == bytes(16), "zero() clears its range",
           inside.hex())
    report(before == b"\xcd" * 16 and after == b"\xcd" * 16, "zero() leaves the neighbours alone",
           f"{before.hex()} {after.hex()}")

    child = spawn(["daemon", uuid], visible=uuid)
    report(child.returncode == 0, "daemon half under CUDA_VISIBLE_DEVICES=<uuid> serves the UUID",
           (child.stdout + child.stderr).strip()[-600:])

    _, fine = memory.allocate_chunk(2 * MiB + ALIGNMENT, uuid, FLAG_FINE_GRAINED)
    report(True, "fine-grained flag accepted (no-op on NVIDIA)")
    memory.free_chunk(fine)

    try:
        memory.allocate_chunk(MiB, "GPU-00000000-0000-0000-0000-000000000000", 0)
        report(False, "unknown UUID refused")
    except UnknownDevice as err:
        report(True, "unknown UUID refused", str(err))
    try:
        memory.allocate_chunk(1 << 47, uuid, 0)
        report(False, "128 TiB refused")
    except OutOfDeviceMemory as err:
        report(True, "128 TiB refused as out of device memory", str(err))
    _, again = memory.allocate_chunk(MiB, uuid, 0)
    report(True, "allocation works after an out-of-memory failure")
    memory.free_chunk(again)

    free_before = check(cudart.cudaMemGetInfo(), "cudaMemGetInfo")[0]
    memory.free_chunk(token)
    free_after = check(cudart.cudaMemGetInfo(), "cudaMemGetInfo")[0]
    report(free_after - free_before >= 4 * MiB, "free gives the memory back", f"+{(free_after - free_before) / MiB:.0f} MiB")
    memory.close()

    from peerd.backends import memory_backend

    report(memory_backend("auto").name == "cuda", "memory_backend('auto') picks cuda on a GPU machine")
    print(f"{'ALL PASS' if not failures else f'{failures} FAILURE(S)'}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    mode, args = (sys.argv[1], sys.argv[2:]) if len(sys.argv) > 1 else ("parent", [])
    if mode == "worker":
        worker(args[0], int(args[1]), args[2], args[3])
    elif mode == "daemon":
        daemon_under(args[0])
    elif mode == "footprint":
        footprint(args[0])
    else:
        parent()
