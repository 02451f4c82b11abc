"""The daemon's per-GPU context footprint against a default context.

    python bench/gpu_footprint.py                 # needs a CUDA GPU, cuda-bindings, nvidia-ml-py

On an otherwise idle GPU 0, the device's used memory as NVML reports it is
read before and while each of these holds a context, one at a time:

  peerd serve --backend cuda   the daemon, idle (its own report, from
                               `peerd status`, is shown beside it)
  default context              a process that only calls cudaFree(0) through
                               cuda-bindings: the context every CUDA process
                               pays, with the default 1 KiB stack limit
  torch context                torch.zeros(1, device="cuda"): what a torch
                               worker pays before allocating anything

The table gives each one's MiB and the ratio daemon / default.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

HOLDERS = {
    "default context (cudaFree(0), cuda-bindings)": (
        "try:\n from cuda.bindings import runtime as rt\nexcept ImportError:\n from cuda import cudart as rt\n"
        "rt.cudaSetDevice(0); rt.cudaFree(0); rt.cudaDeviceSynchronize()\n"
    ),
    "torch context (torch.zeros(1, device='cuda'))": (
        "import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()\n"
    ),
}


def used() -> int:
    import pynvml

    pynvml.nvmlInit()
    try:
        return pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used
    finally:
        pynvml.nvmlShutdown()


def settle(baseline: int | None = None, timeout: float = 20.0) -> int:
    """Used memory once it stops moving (and is back near ``baseline`` if given)."""
    deadline = time.monotonic() + timeout
    last = used()
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = used()
        if now == last and (baseline is None or abs(now - baseline) < 4 * C.MiB):
            return now
        last = now
    return last


def hold(code: str) -> int:
    """Used-memory delta while a process running ``code`` holds its context."""
    before = settle()
    proc = subprocess.Popen([sys.executable, "-c", code + "import sys, time; print('ready', flush=True); "
                             "sys.stdin.readline()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready", "the context holder failed"
    during = settle()
    proc.stdin.write("\n")
    proc.stdin.flush()
    proc.wait(30)
    settle(before)
    return during - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    info = {"bench": "gpu_footprint", "machine": C.machine(), "backend": "cuda", "command": C.command_line()}
    baseline = settle()
    daemon = C.Daemon("cuda").start()
    try:
        during = settle()
        status = daemon.call("status")
        device = status["devices"][0]
        info["daemon"] = {"measured": during - baseline, "reported": device.get("footprint_bytes"),
                          "device": device.get("name"), "rss": daemon.rss()}
    finally:
        daemon.stop()
    settle(baseline)
    for name, code in HOLDERS.items():
        info[name] = hold(code)

    d = info["daemon"]["measured"]
    default = info["default context (cudaFree(0), cuda-bindings)"]
    rows = [["peerd serve --backend cuda (NVML delta)", f"{d / C.MiB:.0f}", C.ratio(d, default)]]
    if info["daemon"]["reported"] is not None:
        rows.append(["  as `peerd status` reports it", f"{info['daemon']['reported'] / C.MiB:.0f}",
                     C.ratio(info["daemon"]["reported"], default)])
    for name in HOLDERS:
        rows.append([name, f"{info[name] / C.MiB:.0f}", C.ratio(info[name], default)])
    print(f"\nper-GPU context footprint on {info['daemon']['device']}, MiB (ratio = / default context)")
    print(C.table(["holder", "MiB", "ratio"], rows))
    C.save("gpu_footprint", info, args.out)


if __name__ == "__main__":
    main()
