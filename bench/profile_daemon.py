"""Where the daemon spends its time under load: py-spy on a private daemon.

    python bench/profile_daemon.py --mode votes --groups 64        # tp_agree load
    python bench/profile_daemon.py --mode cycles --groups 64       # join+commit+release load
    python bench/profile_daemon.py --mode setup --npes 8           # PeerBuffer setups (client side too)

Starts ``peerd serve --backend host`` (or ``--backend cuda``) under ``py-spy record`` (``pip install
py-spy``; it needs ptrace permission over its child), drives it with
bench/throughput.py's clients (votes, cycles) or with PeerBuffer setups,
then prints the functions with the most samples, inclusive and self, from
py-spy's collapsed stacks. ``--client`` profiles rank 0 of the workload
instead of the daemon. The flame graph (SVG) and the raw stacks are written
beside the JSON (bench/results/ by default).
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
import throughput as T  # noqa: E402


def pyspy() -> str:
    found = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(found):
        sys.exit("py-spy is not installed: pip install py-spy")
    return found


def _setup_worker(rank, npes, rounds, start, results, profile_out, backend) -> None:
    from peerd_client import PeerBuffer, tp_agree

    device = C.torch_device(backend)
    proc = None
    if profile_out and rank == 0:
        proc = subprocess.Popen([pyspy(), "record", "--rate", "1000", "--format", "raw", "-o", profile_out,
                                 "--pid", str(os.getpid())], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)
    for i in range(rounds):
        start.wait(rank)
        buf = PeerBuffer(1 << 20, f"prof-{i}", rank, npes, device)
        tp_agree(True, f"prof-{i}", rank, npes)
        buf.close()
    if proc:
        proc.send_signal(2)
        proc.wait(30)
    results.put(rank)


def collapse(path: str, top: int) -> tuple[list, list, int]:
    """(inclusive, self) sample counts per function from py-spy's raw (collapsed) output."""
    inclusive, own = collections.Counter(), collections.Counter()
    total = 0
    for line in open(path):
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack:
            continue
        n = int(count)
        frames = stack.split(";")
        total += n
        names = []
        for f in frames:
            name = f.split(" (")[0] + " " + (f.split(" (")[1].split(":")[0].rsplit("/", 1)[-1] if " (" in f else "")
            names.append(name.strip())
        for name in set(names):
            inclusive[name] += n
        own[names[-1]] += n
    return inclusive.most_common(top), own.most_common(top), total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["votes", "cycles", "setup"], default="votes")
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--npes", type=int, default=2)
    parser.add_argument("--backend", choices=["host", "cuda"], default="host", help="the daemon's backend "
                        "(setup mode: the workers' buffers on GPU 0 for cuda)")
    parser.add_argument("--per-process", type=int, default=20000, help="votes or cycles per client process")
    parser.add_argument("--rounds", type=int, default=100, help="setups, for --mode setup")
    parser.add_argument("--client", action="store_true", help="profile rank 0 (setup mode) instead of the daemon")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", default=str(C.RESULTS))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    tag = f"{args.mode}-{'client' if args.client else 'daemon'}"
    raw = os.path.join(args.out, f"profile-{tag}.txt")

    daemon = C.Daemon(args.backend)
    if not args.client:
        daemon.command = [pyspy(), "record", "--rate", "1000", "--format", "raw", "-o", raw, "--"] + daemon.command
    daemon.start()
    try:
        ctx = mp.get_context("spawn")
        start = C.Start(ctx, args.npes, lead=0.05)
        results = ctx.Queue()
        t0 = time.monotonic()
        if args.mode == "setup":
            procs = [ctx.Process(target=_setup_worker, args=(r, args.npes, args.rounds, start, results,
                                                            raw if args.client else None, args.backend))
                     for r in range(args.npes)]
        else:
            per_group = max(1, args.per_process // args.groups)
            plan = [(f"prof-{args.mode}", "peerd", args.mode, args.groups, per_group)]
            procs = [ctx.Process(target=T.worker, args=(r, args.npes, 0, plan, start, results))
                     for r in range(args.npes)]
        for p in procs:
            p.start()
        for _ in procs:
            got = results.get(timeout=600)
            if isinstance(got, tuple) and got[-1]:
                raise RuntimeError(got[-1])
        for p in procs:
            p.join(30)
        print(f"workload: {time.monotonic() - t0:.1f}s")
    finally:
        # stop the daemon under py-spy (its child) first: py-spy writes its output once its target exits
        if not args.client:
            import signal as _s

            for line in subprocess.run(["pgrep", "-P", str(daemon.pid)], capture_output=True, text=True).stdout.split():
                os.kill(int(line), _s.SIGTERM)
            daemon.proc.wait(60)
        daemon.stop()
    inclusive, own, total = collapse(raw, args.top)
    print(f"\n{tag}: {total} samples (1 kHz); inclusive")
    print(C.table(["function", "samples", "%"], [[f, n, f"{100 * n / total:.1f}"] for f, n in inclusive]))
    print(f"\n{tag}: self")
    print(C.table(["function", "samples", "%"], [[f, n, f"{100 * n / total:.1f}"] for f, n in own]))
    print(f"raw stacks: {raw}")


if __name__ == "__main__":
    main()
