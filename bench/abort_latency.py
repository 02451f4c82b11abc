"""Abort latency: a rank SIGKILLed while its peers wait inside the all-reduce, until each peer's call raises.

    python bench/abort_latency.py --backend cuda              # N = 2, 4, 8 processes on GPU 0
    python bench/abort_latency.py --backend host --ranks 2    # the host twin, anywhere

A daemon of its own serves N worker processes of one group. Each builds a
PeerBuffer (the daemon hands it the set's control page) and makes three
all-reduces; then rank N-1 holds back and every other rank calls once more,
which can only end when the daemon, seeing the holder's death, sets the
group's abort word. The bench waits until every caller is inside its call
(plus ``--settle`` seconds), takes the wall clock, SIGKILLs the holder, and
reports for each caller the time from the kill until its call raised (the
kernel polls the abort word from the GPU; the host twin between sleeps).
The kill-to-raise time bounds the issue's target, which starts from the
daemon seeing the death.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402


def worker(args) -> None:
    import torch

    from peerd_client import PeerBuffer
    from peerd_client.allreduce import all_reduce

    device = C.torch_device(args.backend)
    buf = PeerBuffer(1 << 20, args.group, args.rank, args.npes, device)
    if not buf.abort_address:
        raise RuntimeError("the group has no control page: nothing to abort")
    x = torch.ones(4096, device=device)
    for _ in range(3):
        all_reduce(buf, x, abort=buf.abort_source)
    if args.rank == args.npes - 1:
        print(json.dumps({"holding": True}), flush=True)
        time.sleep(600)
    print(json.dumps({"calling": True}), flush=True)
    try:
        all_reduce(buf, x, abort=buf.abort_source)
        outcome = {"raised_at": None}
    except Exception as err:
        outcome = {"raised_at": time.time(), "type": type(err).__name__, "message": str(err)}
    print(json.dumps(outcome), flush=True)


def one_run(npes: int, args) -> list[float]:
    """Seconds from the kill until each caller's call raised."""
    group = f"abort-{npes}-{uuid.uuid4().hex[:6]}"
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", "--backend", args.backend, "--rank", str(r),
                               "--npes", str(npes), "--group", group], stdout=subprocess.PIPE, text=True)
             for r in range(npes)]
    *callers, holder = procs
    try:
        for p in procs:
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"a worker of N={npes} exited {p.wait()} before its call")
        time.sleep(args.settle)
        killed_at = time.time()
        holder.send_signal(signal.SIGKILL)
        latencies = []
        for p in callers:
            outcome = json.loads(p.stdout.readline())
            if outcome["raised_at"] is None or "MEMBER_DIED" not in outcome["message"]:
                raise RuntimeError(f"a caller of N={npes} did not see the death: {outcome}")
            latencies.append(outcome["raised_at"] - killed_at)
        return latencies
    finally:
        for p in procs:
            p.kill()
            p.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["host", "cuda"], default="cuda")
    parser.add_argument("--ranks", default="2,4,8")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--settle", type=float, default=0.2, help="seconds between the last caller's start "
                        "and the kill, so every caller waits inside its call")
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--rank", type=int)
    parser.add_argument("--npes", type=int)
    parser.add_argument("--group")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    info = {"bench": "abort_latency", "machine": C.machine(), "backend": args.backend, "command": C.command_line(),
            "by_n": {}}
    rows = []
    with C.Daemon(args.backend, log_level="warning"):
        for npes in C.parse_ints(args.ranks):
            runs = [one_run(npes, args) for _ in range(args.repeats)]
            slowest = [max(r) for r in runs]
            info["by_n"][str(npes)] = {"runs": runs, "slowest": C.summary(slowest)}
            rows.append([npes, C.ms(C.quantile(slowest, 0.5)), C.ms(max(slowest)),
                         C.ms(min(min(r) for r in runs))])
            C.save(f"abort_latency-{args.backend}", info, args.out, quiet=True)
    print(f"\nfrom SIGKILL of one rank until every peer's all-reduce raised, ms ({args.backend}, "
          f"{args.repeats} runs per N)")
    print(C.table(["N", "slowest peer p50", "slowest peer max", "fastest peer min"], rows))
    C.save(f"abort_latency-{args.backend}", info, args.out)


if __name__ == "__main__":
    main()
