"""hip-python's real bindings over the HIP shim, on a machine without a GPU driver.

The shim (tests/hipshim/) answers every call with hipErrorNoDevice where
libcuda.so.1 is missing, so the bindings' load and error paths run here; the
GPU paths run in tests/gpu/test_hip.py.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SHIM = Path(__file__).parents[1] / "hipshim"


def _skip_reason() -> str | None:
    if importlib.util.find_spec("hip") is None:
        return "hip-python is not installed"
    if shutil.which("gcc") is None:
        return "no gcc to build the HIP shim"
    if any(Path(d).joinpath("libcuda.so.1").exists() for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib")):
        return "a CUDA driver is installed: tests/gpu/test_hip.py covers this machine"
    return None


REASON = _skip_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")


@pytest.fixture(scope="module")
def shim_env(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("hipshim")
    subprocess.run(["bash", str(SHIM / "build.sh"), str(out)], check=True, capture_output=True, text=True)
    return {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(out), os.environ.get("LD_LIBRARY_PATH")]))}


def test_the_backend_reaches_the_runtime_and_reports_no_device(shim_env):
    probe = ("from peerd.backends import BackendUnavailable, hip\n"
             "for half in (hip.Memory, hip.Mapper):\n"
             "    try:\n        half()\n    except BackendUnavailable as err:\n        print(err)\n"
             "from peerd.backends import memory_backend\n"
             "print('auto:', memory_backend('auto').name)\n")
    result = subprocess.run([sys.executable, "-c", probe], env=shim_env, capture_output=True, text=True, timeout=60)
    lines = result.stdout.strip().splitlines()
    assert lines == ["no usable HIP device: hipGetDeviceCount failed: hipErrorNoDevice"] * 2 + ["auto: host"], result


def test_serve_refuses_the_hip_backend_with_the_reason(shim_env, socket_dir):
    sock = os.path.join(socket_dir, "peerd.sock")
    refused = subprocess.run([sys.executable, "-m", "peerd", "serve", "--backend", "hip", "--socket", sock],
                             env=shim_env, capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "hipErrorNoDevice" in refused.stderr, refused.stderr
