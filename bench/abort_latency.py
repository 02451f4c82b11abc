"""Abort latency: a rank SIGKILLed while its peers wait inside the all-reduce, until each peer's call raises.

    python bench/abort_latency.py --backend cuda              # N = 2, 4, 8 processes on GPU 0
    python bench/abort_latency.py --backend host --ranks 2    # the host twin, anywhere

A daemon of its own serves N worker processes of one group. Each builds a
PeerBuffer (the daemon hands it the set's control page) and makes three
all-reduces; then rank N-1 holds back and every other rank calls once more,
which can only end when the daemon, seeing the holder's death, sets the
group's abort word. The bench waits until every caller is inside its call
(plus ``--settle`` seconds), takes the wall clock, SIGKILLs the holder, and
reports for each caller two times until its call raised (the kernel polls
the abort word from the GPU; the host twin between sleeps): from the kill,
which includes the OS reaping the killed process and its GPU context before
the daemon's pidfd fires, and from the instant the daemon, seeing the death,
wrote the abort word (the page records it: ControlPage.aborted_at, on the
CLOCK_MONOTONIC every process of the machine shares).
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
    from peerd_client.pagelink import link_for

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
        raised, raised_mono = time.time(), time.monotonic()
        written = link_for(args.group).page.aborted_at  # None: its aborter stopped before writing the instant
        outcome = {"raised_at": raised, "after_abort": None if written is None else raised_mono - written,
                   "type": type(err).__name__, "message": str(err)}
    print(json.dumps(outcome), flush=True)


def one_run(npes: int, args) -> tuple[list[float], list[float]]:
    """Seconds until each caller's call raised: from the kill, and from the daemon's abort write."""
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
        latencies, after_abort = [], []
        for p in callers:
            outcome = json.loads(p.stdout.readline())
            if outcome["raised_at"] is None or "MEMBER_DIED" not in outcome["message"]:
                raise RuntimeError(f"a caller of N={npes} did not see the death: {outcome}")
            latencies.append(outcome["raised_at"] - killed_at)
            if outcome["after_abort"] is not None:  # else its aborter stopped before it wrote the instant
                after_abort.append(outcome["after_abort"])
        return latencies, after_abort
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
            runs, after = zip(*(one_run(npes, args) for _ in range(args.repeats)))
            slowest, slowest_after = [max(r) for r in runs], [max(r) for r in after if r]
            info["by_n"][str(npes)] = {"runs": runs, "slowest": C.summary(slowest), "after_abort": after,
                                       "slowest_after_abort": C.summary(slowest_after)}
            rows.append([npes, C.ms(C.quantile(slowest, 0.5)), C.ms(max(slowest)),
                         C.ms(C.quantile(slowest_after, 0.5)), C.ms(max(slowest_after, default=float("nan")))])
            C.save(f"abort_latency-{args.backend}", info, args.out, quiet=True)
    print(f"\nuntil every peer's all-reduce raised, ms ({args.backend}, {args.repeats} runs per N): from the "
          "SIGKILL of one rank, and from the daemon's abort write once it saw the death")
    print(C.table(["N", "from kill p50", "max", "from abort write p50", "max"], rows))
    C.save(f"abort_latency-{args.backend}", info, args.out)


if __name__ == "__main__":
    main()
