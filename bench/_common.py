"""Shared pieces of the benchmarks: a private daemon, the seed path, statistics, tables.

Every benchmark starts its own ``peerd serve`` on a private socket and its own
worker processes, and measures peerd and the seed approach in the same run.
The seed path is the seeds' handshake (shared/seeds/*.txt): each rank
allocates its own buffer, ``all_gather_object``s the handles over a gloo
process group, opens its peers', and runs ``all_reduce(MIN)`` as the
agreement. On the host backend a POSIX shared-memory segment stands in for
cudaMalloc and its name for the IPC handle; on the GPU it is cudaMalloc +
cudaIpcGetMemHandle / cudaIpcOpenMemHandle through cuda-bindings, as seed 001.

Times are CLOCK_MONOTONIC (``time.monotonic``), which every process of one
machine shares, so a "common start" is one instant every worker sleeps until.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as _dt
import json
import mmap
import os
import platform
import shutil
import signal
import socket as _socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from peerd_client.connection import daemon_answers

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
SHM_DIR = "/dev/shm"
MiB = 1 << 20


# ---------------------------------------------------------------- statistics and output


def quantile(samples: list[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default) of a non-empty list."""
    xs = sorted(samples)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary(samples: list[float]) -> dict:
    return {
        "n": len(samples),
        "p50": quantile(samples, 0.5),
        "p90": quantile(samples, 0.9),
        "p99": quantile(samples, 0.99),
        "min": min(samples) if samples else float("nan"),
        "max": max(samples) if samples else float("nan"),
        "mean": sum(samples) / len(samples) if samples else float("nan"),
    }


def table(header: list[str], rows: list[list]) -> str:
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(header: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(map(str, header)) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return "\n".join(out)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}" if seconds < 0.1 else f"{seconds * 1e3:.1f}"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def machine() -> dict:
    """Where the numbers came from."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.node(),
        "kernel": platform.release(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:
        pass
    try:  # through NVML: a CUDA call here would give this process a context of its own
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            name = pynvml.nvmlDeviceGetName(handle)
            info["gpu"] = name.decode() if isinstance(name, bytes) else str(name)
            driver = pynvml.nvmlSystemGetDriverVersion()
            info["driver"] = driver.decode() if isinstance(driver, bytes) else str(driver)
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        pass
    return info


def save(name: str, data: dict, out: str | None, quiet: bool = False) -> Path:
    """Write the run's JSON to ``out`` (a file or folder), default bench/results/NAME.json."""
    path = Path(out) if out else RESULTS / f"{name}.json"
    if path.suffix != ".json":
        path = path / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True))
    if not quiet:
        print(f"results: {path}")
    return path


def command_line() -> str:
    return " ".join(["python", os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])


def measure_each_n(name: str, info: dict, args, measure) -> None:
    """Run measure(npes, args) for every N of --ranks against one daemon, saving after each N
    (what is done survives a later overrun); the daemon's exit status goes into info."""
    with Daemon(args.backend, timeline=getattr(args, "timeline_file", None)) as daemon:
        for npes in parse_ints(args.ranks):
            t0 = time.monotonic()
            info["by_n"][str(npes)] = measure(npes, args)
            print(f"N={npes}: done in {time.monotonic() - t0:.1f}s", flush=True)
            save(name, info, args.out, quiet=True)
        info["daemon_exit"] = daemon.stop()


def setup_parser(doc: str, ranks: str, iters: int, warmup: int, lead: float, timeout: float,
                 nbytes_help: str) -> argparse.ArgumentParser:
    """The options of the benchmarks that time a setup from a common start (setup_latency, rendezvous_floor)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--backend", choices=["host", "cuda"], default="host")
    parser.add_argument("--ranks", default=ranks, help="comma-separated N values")
    parser.add_argument("--iters", type=int, default=iters, help="measured iterations per path and N")
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--nbytes", type=int, default=None, help=nbytes_help)
    parser.add_argument("--lead", type=float, default=lead, help="seconds from the barrier to the common start")
    parser.add_argument("--timeout", type=float, default=timeout)
    parser.add_argument("--out", default=None, help="JSON file or folder (default bench/results/)")
    return parser


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


# ---------------------------------------------------------------- timing


#: spin the last this many seconds before a common start (sleep alone wakes ~60 us late;
#: spinning longer steals the core a daemon or a peer needs where cores are few)
SPIN_S = float(os.environ.get("PEERD_BENCH_SPIN_S", "0.0001"))
#: the spin of a worker pinned to cores of its own (--pin): it steals nobody's core, and a worker that
#: sleeps to the instant wakes up to a few hundred us late now and then, which a 20 us round would report
PINNED_SPIN_S = 0.001


def spin_s(pinned: bool) -> float:
    """The spin before each common start that a run uses (recorded with its results)."""
    return max(SPIN_S, PINNED_SPIN_S) if pinned else SPIN_S


_spin = SPIN_S  # this process's: spin_s(pinned), set by a pinned worker


def sleep_until(instant: float) -> float:
    """Sleep until monotonic ``instant``; how late we woke (seconds, >= 0 when on time)."""
    left = instant - time.monotonic()
    if left > _spin:
        time.sleep(left - _spin)
    while time.monotonic() < instant:
        pass
    return time.monotonic() - instant


class Start:
    """A common start for the workers of one run: a barrier, then one instant.

    Rank 0 picks ``lead`` seconds from now once every worker reached the
    barrier; every worker sleeps until then. Built from a spawn context's
    Barrier and Value, so it crosses process boundaries.
    """

    def __init__(self, ctx, parties: int, lead: float = 0.02):
        self.barrier = ctx.Barrier(parties)
        self.value = ctx.Value("d", 0.0, lock=False)
        self.lead = lead

    def wait(self, rank: int) -> tuple[float, float]:
        """(the common instant, how late this rank started after it)."""
        self.barrier.wait()
        if rank == 0:
            self.value.value = time.monotonic() + self.lead
        self.barrier.wait()
        instant = self.value.value
        return instant, sleep_until(instant)


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free right now on 127.0.0.1."""
    socks, ports = [], []
    for _ in range(count):
        s = _socket.socket()
        s.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


# ---------------------------------------------------------------- the daemon



class Daemon:
    """``python -m peerd serve`` on a private socket under /tmp (short: < 108 bytes)."""

    def __init__(self, backend: str = "host", log_level: str = "info", args: tuple[str, ...] = (),
                 env: dict | None = None, timeline: str | None = None):
        self.dir = tempfile.mkdtemp(prefix="pb-", dir="/tmp")
        self.socket = os.path.join(self.dir, "peerd.sock")
        self.log = Path(self.dir) / "daemon.log"
        self.backend = backend
        # timeline: a file the daemon writes its requests' times to when it stops (bench/_daemon_timeline.py)
        runs = [str(ROOT / "bench" / "_daemon_timeline.py"), timeline] if timeline else ["-m", "peerd"]
        self.command = [sys.executable, *runs, "serve", "--backend", backend, "--socket", self.socket,
                        "--log-level", log_level, *args]
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60) -> "Daemon":
        self.proc = subprocess.Popen(self.command, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT,
                                     env=self.env, cwd=ROOT)
        deadline = time.monotonic() + timeout
        while not (os.path.exists(self.socket) and daemon_answers(self.socket)):
            if self.proc.poll() is not None:
                raise RuntimeError(f"peerd exited {self.proc.returncode} at start:\n{self.log.read_text()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"peerd did not answer within {timeout}s:\n{self.log.read_text()}")
            time.sleep(0.05)
        os.environ["PEERD_SOCKET"] = self.socket  # spawned workers inherit it
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss(self) -> int:
        """The daemon's resident set, bytes (VmRSS)."""
        for line in open(f"/proc/{self.pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def call(self, op: str, body: dict | None = None) -> dict:
        from peerd_client.connection import Connection

        conn = Connection(self.socket)
        try:
            return conn.call(op, body or {})
        finally:
            conn.close()

    def stop(self) -> int:
        code = 0
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                code = self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
        return code

    def __enter__(self) -> "Daemon":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ---------------------------------------------------------------- the seed path


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def _map_shm(path: str, size: int, create: bool) -> int:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, size)  # zero-filled, as cudaMalloc + cudaMemset
        address = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    finally:
        os.close(fd)
    if address in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
    return address


class HostSeedMemory:
    """Seed allocation on the host: each rank's own POSIX shm segment; the handle is its name."""

    def __init__(self, device=None):
        self.device = device

    def alloc(self, nbytes: int, tag: str) -> tuple[bytes, object]:
        size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        name = f"pbseed-{os.getpid()}-{tag}"
        address = _map_shm(os.path.join(SHM_DIR, name), size, create=True)
        return name.encode(), (address, size, name)

    @staticmethod
    def local_address(token) -> int:
        return token[0]

    def open(self, handle: bytes, nbytes: int) -> int:
        size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        return _map_shm(os.path.join(SHM_DIR, handle.decode()), size, create=False)

    def close(self, address: int, nbytes: int) -> None:
        _libc.munmap(address, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)

    def free(self, token) -> None:
        address, size, name = token
        _libc.munmap(address, size)
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            pass


def _cudart():
    try:
        from cuda.bindings import runtime as rt  # cuda-bindings >= 12.6
    except ImportError:
        from cuda import cudart as rt  # older cuda-python
    return rt


class CudaSeedMemory:
    """Seed 001 on the GPU: cudaMalloc + cudaMemset + cudaIpcGetMemHandle; peers cudaIpcOpenMemHandle.

    cuda-bindings' runtime calls, the same ones (and flags) peerd's cuda
    backend makes, so the two paths differ only in who allocates and how the
    handles travel.
    """

    HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)

    def __init__(self, device):
        self.rt = _cudart()
        self.device = device

    def _ok(self, result, what: str):
        err, *values = result
        if err != self.rt.cudaError_t.cudaSuccess:
            raise RuntimeError(f"{what} failed: {err}")
        return values[0] if len(values) == 1 else (tuple(values) or None)

    def alloc(self, nbytes: int, tag: str) -> tuple[bytes, object]:
        rt = self.rt
        pointer = self._ok(rt.cudaMalloc(nbytes), "cudaMalloc")
        self._ok(rt.cudaMemset(pointer, 0, nbytes), "cudaMemset")
        self._ok(rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
        handle = self._ok(rt.cudaIpcGetMemHandle(pointer), "cudaIpcGetMemHandle")
        return ctypes.string_at(handle.getPtr(), self.HANDLE_BYTES), int(pointer)

    @staticmethod
    def local_address(token) -> int:
        return token

    def open(self, handle: bytes, nbytes: int) -> int:
        rt = self.rt
        ipc = rt.cudaIpcMemHandle_t()
        ctypes.memmove(ipc.getPtr(), handle, self.HANDLE_BYTES)
        return int(self._ok(rt.cudaIpcOpenMemHandle(ipc, rt.cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle"))

    def close(self, address: int, nbytes: int) -> None:
        self._ok(self.rt.cudaIpcCloseMemHandle(address), "cudaIpcCloseMemHandle")

    def free(self, token) -> None:
        self._ok(self.rt.cudaFree(token), "cudaFree")


def seed_memory(backend: str, device):
    return CudaSeedMemory(device) if backend == "cuda" else HostSeedMemory(device)


class SeedBuffer:
    """The seeds' PeerBuffer over a gloo group: allocate, all_gather_object, open, all_reduce(MIN)."""

    def __init__(self, memory, nbytes: int, rank: int, npes: int, tag: str, group=None, marks: dict | None = None):
        import torch
        import torch.distributed as dist

        from peerd_client.views import byte_view

        mark = (lambda what: marks.__setitem__(what, time.monotonic())) if marks is not None else (lambda what: None)
        self.memory, self.nbytes, self.rank = memory, nbytes, rank
        handle, self.token = memory.alloc(nbytes, tag)
        mark("allocated")
        local = memory.local_address(self.token)
        self.opened: list[int] = []
        handles: list = [None] * npes
        dist.all_gather_object(handles, handle, group=group)
        mark("gathered")
        pointers, failure = [], None
        try:
            for peer, raw in enumerate(handles):
                if peer == rank:
                    pointers.append(local)
                else:
                    address = memory.open(raw, nbytes)
                    self.opened.append(address)
                    pointers.append(address)
        except Exception as err:  # every rank must still reach the agreement
            failure = err
        mark("opened")
        flag = torch.tensor([int(failure is None)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        mark("agreed")
        if not flag.item():
            raise RuntimeError(f"seed handshake failed: {failure}")
        device = memory.device
        self.pointers = pointers
        self.bytes = byte_view(local, nbytes, device)
        self.addresses = torch.tensor(pointers, dtype=torch.int64, device=device)

    def unmap(self) -> None:
        """Close the peers' mappings (every rank, before any frees)."""
        self.bytes = self.addresses = None
        opened, self.opened = self.opened, []
        for address in opened:
            self.memory.close(address, self.nbytes)

    def free(self) -> None:
        if self.token is not None:
            self.memory.free(self.token)
            self.token = None


def init_gloo(port: int, rank: int, npes: int, timeout_s: float = 60.0) -> None:
    """The seeds' CPU process group: gloo over a TCP store on 127.0.0.1:port (rank 0 hosts it)."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=npes,
        timeout=_dt.timedelta(seconds=timeout_s),
    )


def torch_device(backend: str):
    import torch

    if backend == "cuda":
        torch.cuda.set_device(0)
        torch.zeros(1, device="cuda")  # the worker's context exists before any timing
        return torch.device("cuda", 0)
    return torch.device("cpu")


def reset_peerd_connection() -> None:
    """Make this process as fresh to peerd as a new one: its daemon connection dropped and every arena chunk
    it kept mapped unmapped, so the next buffer connects, greets and opens each chunk afresh (a first use)."""
    import peerd_client.connection as pc
    from peerd_client.mappings import mappings

    with pc._connection_lock:
        if pc._connection is not None:
            pc._connection.close()
            pc._connection = None
    mappings.unmap_unused()


def leftover_seed_segments() -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if n.startswith("pbseed-")]
