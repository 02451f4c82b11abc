"""All-reduce latency: peerd's one-shot kernel against torch.distributed's NCCL,
in the same worker processes of the same run, on processes sharing ONE GPU.

    python bench/allreduce.py [--ranks 2,4,8] [--json FILE]

Starts a cuda daemon of its own (``peerd serve --backend cuda``). Prints a
Markdown table: per group size and message size (bf16), each path's time per
call (the slowest rank's median over repetitions), NCCL's time over peerd's,
and how far the two sums differ (NCCL adds in bf16, in ring order). peerd's
kernel runs twice: polling the group's abort word on its control page (the
default) and with ``abort=None``; "polling cost" is the first over the second.

Processes sharing one GPU are not the target topology: the GPU time-slices
their contexts, so both paths mostly measure context switches, never the
links. A multi-GPU run measures what the kernel is for. NCCL also refuses
two ranks on one GPU ("Duplicate GPU detected"; the run shows it): each rank
here gets its own NCCL_HOSTID, so NCCL takes every rank for a separate host
and runs over its socket transport on the loopback interface, the only way
it runs on this topology.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

SIZES = [1 << k for k in range(10, 21, 2)]  # 1 KiB .. 1 MiB
WARMUP, REPS, CALLS = 2, 5, 5
NCCL_ENV = {"NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1", "NCCL_NVLS_ENABLE": "0"}


def per_call(fn, barrier) -> float:
    """Median over REPS of the mean time of CALLS back-to-back calls, in seconds."""
    import torch

    for _ in range(WARMUP):
        fn()
    samples = []
    for _ in range(REPS):
        torch.cuda.synchronize()
        barrier()
        start = time.perf_counter()
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / CALLS)
    return statistics.median(samples)


def worker(args) -> dict:
    import torch
    import torch.distributed as dist

    from peerd_client import PeerBuffer, tp_agree
    from peerd_client.allreduce import all_reduce

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{args.store}", rank=args.rank, world_size=args.npes,
                            device_id=device)
    if args.probe:  # plain NCCL, two ranks on one GPU
        x = torch.ones(4, device=device)
        dist.all_reduce(x)
        torch.cuda.synchronize()
        return {"probe": "NCCL ran"}
    buf = PeerBuffer(2 * max(SIZES) + 4096, args.group, args.rank, args.npes, device)
    if not buf.abort_address:
        raise RuntimeError("the group has no control page: the polling cost cannot be measured")
    def barrier():
        tp_agree(True, args.group)

    rows = []
    for size in SIZES:
        x = torch.randn(size // 2, generator=torch.Generator().manual_seed(args.rank)).to(torch.bfloat16).to(device)
        ours, theirs = all_reduce(buf, x), x.clone()
        dist.all_reduce(theirs)
        out, scratch = torch.empty_like(x), x.clone()
        rows.append({
            "bytes": size,
            "difference": float((ours.float() - theirs.float()).norm() / theirs.float().norm()),
            "peerd_s": per_call(lambda: all_reduce(buf, x, out), barrier),
            "unpolled_s": per_call(lambda: all_reduce(buf, x, out, abort=None), barrier),
            "nccl_s": per_call(lambda: dist.all_reduce(scratch), barrier),
        })
    buf.close()
    dist.destroy_process_group()
    return {"rows": rows}


def launch(npes: int, probe: bool, timeout: float) -> list[dict]:
    group = f"bench-ar-{uuid.uuid4().hex[:8]}"
    store = os.path.join(tempfile.mkdtemp(prefix="pd-bench-"), "store")
    procs = []
    for rank in range(npes):
        env = {**os.environ, **NCCL_ENV}
        if not probe:
            env["NCCL_HOSTID"] = f"{group}-{rank}"
        command = [sys.executable, __file__, "--worker", "--rank", str(rank), "--npes", str(npes),
                   "--group", group, "--store", store] + (["--probe"] if probe else [])
        procs.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    deadline, results = time.monotonic() + timeout, []
    for rank, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        lines = [line for line in out.splitlines() if line.startswith("{")]
        results.append(json.loads(lines[-1]) if lines else {"error": _cause(err, proc.returncode)})
    return results


def _cause(stderr: str, code) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    named = [line for line in lines if "Duplicate GPU" in line or "Error" in line]
    return (named or lines or [f"exited {code}"])[-1][:300]


def machine() -> str:
    import torch

    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True).stdout.strip()
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    import triton

    return (f"{torch.cuda.get_device_name(0)}, driver {driver}, torch {torch.__version__}, "
            f"triton {triton.__version__}, NCCL {nccl}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", default="2,4,8")
    parser.add_argument("--json", default=None)
    parser.add_argument("--timeout", type=float, default=60)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--probe", action="store_true")
    parser.add_argument("--rank", type=int)
    parser.add_argument("--npes", type=int)
    parser.add_argument("--group")
    parser.add_argument("--store")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)), flush=True)
        return

    with C.Daemon("cuda", log_level="warning"):
        report = compare(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


def compare(args) -> dict:
    """Both paths for every group size, printed as rows as they come."""
    report = {"date": datetime.date.today().isoformat(), "machine": machine(), "groups": {}}
    print(f"{report['date']}, {report['machine']}; processes sharing one GPU (not the target topology)")
    probe = launch(2, probe=True, timeout=40)
    report["plain_nccl"] = probe[0].get("error") or probe[0].get("probe")
    print(f"plain NCCL, 2 ranks on one GPU: {report['plain_nccl']}\n")
    print("| ranks | message | peerd one-shot (µs) | NCCL, socket transport (µs) | NCCL / peerd | ‖peerd − NCCL‖ / ‖NCCL‖ "
          "| peerd, abort=None (µs) | polling cost |")
    print("|---|---|---|---|---|---|---|---|")
    for npes in map(int, args.ranks.split(",")):
        results = report["groups"][npes] = launch(npes, probe=False, timeout=args.timeout)
        failed = [r["error"] for r in results if "error" in r]
        if failed:
            print(f"| {npes} | failed: {failed[0]} | | | | | | |", flush=True)
            continue
        for i, size in enumerate(SIZES):
            peerd = max(r["rows"][i]["peerd_s"] for r in results) * 1e6
            nccl = max(r["rows"][i]["nccl_s"] for r in results) * 1e6
            unpolled = max(r["rows"][i]["unpolled_s"] for r in results) * 1e6
            difference = max(r["rows"][i]["difference"] for r in results)
            print(f"| {npes} | {size // 1024} KiB | {peerd:.1f} | {nccl:.1f} | {nccl / peerd:.2f} | "
                  f"{difference:.1e} | {unpolled:.1f} | {peerd / unpolled - 1:+.1%} |", flush=True)
    return report


if __name__ == "__main__":
    main()
