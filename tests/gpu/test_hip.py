"""The HIP backend through hip-python's own bindings, on an NVIDIA GPU.

tests/hipshim/ builds a libamdhip64.so that maps each HIP runtime call the
backend makes to the CUDA driver; with it first on the library path, the real
hip-python bindings (whichever release is importable) drive the real HIP
backend, daemon and workers, on real device memory. This checks the
backend's calls, arguments, struct layouts and error handling; it says
nothing about AMD's driver (see peerd/backends/hip.py).

Skipped, with the reason, without a CUDA GPU, hip-python or a C compiler.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import Daemon, run_ranks

SHIM = Path(__file__).parents[1] / "hipshim"
UNCACHED, FINE_GRAINED = 0x3, 0x1


def _skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no usable CUDA GPU to run the HIP shim on"
    if importlib.util.find_spec("hip") is None:
        return "hip-python is not installed"
    if shutil.which("gcc") is None:
        return "no gcc to build the HIP shim"
    return None


REASON = _skip_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=REASON or "")]


@pytest.fixture(scope="module")
def shim_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hipshim")
    subprocess.run(["bash", str(SHIM / "build.sh"), str(out)], check=True, capture_output=True, text=True)
    return out


@pytest.fixture
def hip_daemon(socket_dir, shim_dir):
    log = Path(socket_dir) / "hipshim.log"
    env = {"LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(shim_dir), os.environ.get("LD_LIBRARY_PATH")])),
           "HIPSHIM_LOG": str(log)}
    d = Daemon(os.path.join(socket_dir, "peerd.sock"), Path(socket_dir) / "daemon.log", backend="hip",
               args=("--max-buffer-bytes", "none"), extra_env=env).start()
    d.shim_log = log
    yield d
    assert d.stop() == 0, d.logs()


def shim_calls(d: Daemon, what: str) -> list[dict]:
    """The shim's record of one kind of call made by the daemon process."""
    calls = []
    for line in d.shim_log.read_text().splitlines() if d.shim_log.exists() else []:
        fields = dict(part.split("=", 1) for part in line.split()[2:])
        if line.split()[1] == what and line.startswith(f"pid={d.proc.pid} "):
            calls.append({"size": int(fields["size"]), "flags": int(fields["flags"], 16), "ptr": fields["ptr"]})
    return calls


def test_the_daemon_serves_the_gpu_through_the_bindings(hip_daemon):
    status = json.loads(hip_daemon.cli("status", "--json").stdout)
    (device,) = status["devices"]
    assert status["backend"] == "hip" and status["health"] == "healthy", status
    assert re.fullmatch(r"GPU-[0-9a-f]{32}", device["uuid"]), device
    assert device["name"] and device["pci_bus_id"] and device["total_bytes"] > 0, device


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_selftest_through_the_hip_mapper_and_every_buffer_uncached(hip_daemon, ranks):
    result = hip_daemon.cli("selftest", "--ranks", str(ranks), timeout=300)
    print(result.stdout)
    assert result.returncode == 0 and f"PASS: {ranks} rank(s)" in result.stdout, result.stdout + result.stderr
    allocations = shim_calls(hip_daemon, "hipExtMallocWithFlags")
    assert allocations and {a["flags"] for a in allocations} == {UNCACHED}, allocations  # chunks, not buffers
    freed = {c["ptr"] for c in shim_calls(hip_daemon, "hipFree")}
    assert {a["ptr"] for a in allocations} <= freed, "close must free every buffer"
    assert json.loads(hip_daemon.cli("status", "--json").stdout)["bytes_allocated"] == 0


def test_fine_grained_is_asked_for_when_the_flag_says_so(hip_daemon):
    from peerd.protocol import FLAG_FINE_GRAINED

    results = run_ranks(hip_daemon, "join", 2, "--group", "fine", "--flags", str(FLAG_FINE_GRAINED))
    assert all(r["ok"] for r in results), results
    assert {a["flags"] for a in shim_calls(hip_daemon, "hipExtMallocWithFlags")} == {FINE_GRAINED}


def test_a_buffer_written_then_freed_comes_back_zeroed(hip_daemon):
    for _ in range(2):  # the second set reuses the device memory the first one dirtied
        result = hip_daemon.cli("selftest", "--ranks", "2", timeout=300)
        assert result.returncode == 0 and "FAIL" not in result.stdout.replace("PASS", ""), result.stdout


def test_out_of_memory_is_a_clear_refusal_that_holds_nothing(hip_daemon):
    (result,) = run_ranks(hip_daemon, "join", 1, "--group", "huge", "--nbytes", str(1 << 40))
    assert result["code"] == "ALLOCATION_FAILED" and "hipErrorOutOfMemory" in result["message"], result
    assert json.loads(hip_daemon.cli("status", "--json").stdout)["bytes_allocated"] == 0


REGISTER_SCRIPT = """
import ctypes, sys
from cuda.bindings import runtime as cudart
from peerd.controlpage import OFF_ABORT, AbortCode, new_instance_id, page_bytes
from peerd.pagearea import Area
from peerd_client.hostmap import _Hip

area = Area.create(page_bytes(2), slots=2)
page = area.page_at(page_bytes(2), page_bytes(2))  # the second slot: its device address is base + offset
page.format(2, new_instance_id(), 1)
hip = _Hip()
hip.register(area.address, area.size)
base = hip.device_pointer(area.address) + page_bytes(2)
page.abort(AbortCode.EVICTED, "through the device mapping")
seen = ctypes.c_uint64()
err, = cudart.cudaMemcpy(ctypes.addressof(seen), base + OFF_ABORT, 8, cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost)
assert err == cudart.cudaError_t.cudaSuccess, err
assert seen.value == page.word(OFF_ABORT).value != 0, (seen.value, page.word(OFF_ABORT).value)
print(area.size)
"""


def test_the_control_page_is_registered_for_kernels_through_hip(shim_dir, tmp_path):
    """The HIP twin of an area's device mapping (hipHostRegister Portable|Mapped of the whole area,
    hipHostGetDevicePointer) through the real bindings: a device load at base + the page's offset sees its
    abort word."""
    log = tmp_path / "hipshim.log"
    env = {**os.environ, "HIPSHIM_LOG": str(log),
           "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(shim_dir), os.environ.get("LD_LIBRARY_PATH")]))}
    done = subprocess.run([sys.executable, "-c", REGISTER_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    size = int(done.stdout.split()[-1])
    calls = [line.split()[1:4] for line in log.read_text().splitlines()]
    assert ["hipHostRegister", f"size={size}", "flags=0x3"] in calls, calls  # Portable | Mapped
