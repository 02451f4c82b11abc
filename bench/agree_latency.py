"""Agreement latency: tp_agree through peerd against all_reduce(MIN) over gloo.

    python bench/agree_latency.py                     # N = 2, 4, 8 on the host
    python bench/agree_latency.py --ranks 8 --rounds 2000 --backend cuda

N worker processes (spawn) each hold a daemon connection and a gloo process
group (both made before timing). Two measurements, peerd and gloo
alternating so that drift hits both alike:

  synchronized rounds (the headline): before each round every rank sleeps
      until one common instant, then calls; the round's latency is the time
      from that instant until the slowest rank has the answer. p50 and p99
      over --sync-rounds rounds per path.
  back-to-back rounds: --rounds rounds in a tight loop, in --blocks blocks;
      the mean round period (latency as OSU-style loops report it) and p50 /
      p99 of every call of every rank (a rank that arrives last waits least,
      so per-call times spread around the period).

The workers' garbage collector is off while they time (a collection pause
would land in whichever path it hit); a round whose last rank still starts
late is reported both ways: from the common instant, and from that rank's
start (the round alone).

``--backend cuda`` only gives every worker a CUDA context on GPU 0 first
(the agreement itself never touches the GPU, in either path).
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

PATHS = ("peerd", "gloo")


def worker(rank, npes, args, start: C.Start, port, results) -> None:
    try:
        from peerd_client import tp_agree

        C.torch_device(args.backend)
        C.init_gloo(port, rank, npes)
        key = f"agree-{npes}"
        timed = time_paths({"peerd": lambda: tp_agree(True, key, rank, npes), "gloo": gloo_round()}, rank, args,
                           start)
        results.put((rank, *timed, None))
    except BaseException:
        results.put((rank, {}, {}, {}, traceback.format_exc()))
        raise


def gloo_round():
    """A round of all_reduce(MIN) of one int over the process's gloo group: True when every rank said 1."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1], dtype=torch.int32)

    def one_round():
        flag.fill_(1)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    return one_round


def time_paths(calls: dict, rank: int, args, start: C.Start, rounds: dict | None = None) -> tuple[dict, dict, dict]:
    """Time every path of ``calls`` (name -> a round returning True) the same way, alternating:
    (per-call durations, per-block round periods, synchronized (elapsed, lag) pairs), by path.
    ``rounds`` gives a slow path fewer back-to-back rounds than ``args.rounds``."""
    import torch.distributed as dist

    paths = list(calls)
    if args.pin:
        pin(rank, dist.get_world_size())
    for fn in calls.values():
        for _ in range(args.warmup):
            assert fn()
    gc.collect()
    gc.disable()  # a collection pause in a worker would land in whichever path it hit: neither's to pay
    durations = {p: [] for p in paths}
    periods = {p: [] for p in paths}
    per_block = {p: max(1, (rounds or {}).get(p, args.rounds) // args.blocks) for p in paths}
    clock = time.perf_counter
    for b in range(args.blocks):
        for path in (paths if b % 2 == 0 else paths[::-1]):
            fn, out = calls[path], durations[path]
            start.wait(rank)
            t_block = clock()
            for _ in range(per_block[path]):
                t0 = clock()
                ok = fn()
                out.append(clock() - t0)
                if not ok:
                    raise RuntimeError(f"{path} agreement returned False")
            periods[path].append((clock() - t_block) / per_block[path])
    synced = {p: [] for p in paths}  # (elapsed from the common instant, start lag) per round
    for j in range(args.sync_rounds):
        for path in (paths if j % 2 == 0 else paths[::-1]):
            instant, late = start.wait(rank)
            ok = calls[path]()
            synced[path].append((time.monotonic() - instant, late))
            if not ok:
                raise RuntimeError(f"{path} agreement returned False")
    gc.enable()
    dist.destroy_process_group()
    return durations, periods, synced


def pin(rank: int, npes: int) -> None:
    """Keep this worker (and its threads: gloo's, ZeroMQ's) on cores of its own, the same for both paths,
    so no worker is migrated or shares a core with another at the common instant."""
    cores = sorted(os.sched_getaffinity(0))
    per = len(cores) // npes
    if per < 1:
        raise SystemExit(f"--pin needs a core per rank: {len(cores)} cores for {npes} ranks")
    mine = cores[rank * per:(rank + 1) * per]
    for thread in os.listdir("/proc/self/task"):  # the affinity is per thread: the running ones too
        os.sched_setaffinity(int(thread), mine)
    C._spin = C.spin_s(pinned=True)  # its cores are its own: spinning to the instant costs nobody


def measure(npes: int, args, target=worker, paths=PATHS, extra: tuple = ()) -> dict:
    """Run ``target(rank, npes, args, start, port, results, *extra)`` on npes spawned
    workers and summarize each of ``paths``."""
    ctx = mp.get_context("spawn")
    start = C.Start(ctx, npes, lead=args.lead)
    results = ctx.Queue()
    (port,) = C.free_ports(1)
    procs = [ctx.Process(target=target, args=(r, npes, args, start, port, results, *extra)) for r in range(npes)]
    for p in procs:
        p.start()
    pooled = {p: [] for p in paths}
    periods = {p: [] for p in paths}
    synced = {p: [] for p in paths}  # per rank: list over rounds
    for _ in range(npes):
        rank, durations, period, sync, error = results.get(timeout=args.timeout)
        if error:
            for p in procs:
                p.kill()
            raise RuntimeError(f"N={npes} rank {rank} failed:\n{error}")
        for path in paths:
            pooled[path] += durations[path]
            synced[path].append(sync[path])
            if rank == 0:
                periods[path] = period[path]
    for p in procs:
        p.join(30)
    out = {}
    for path in paths:
        rounds = list(zip(*synced[path]))  # per round: (elapsed, lag) of every rank
        slowest = [max(e for e, _ in r) for r in rounds]
        out[path] = {
            "sync": {**C.summary(slowest), "max_start_lag": max((l for r in rounds for _, l in r), default=0.0),
                     "start_lag_p50": C.quantile([max(l for _, l in r) for r in rounds], 0.5),
                     # the round alone: from the latest rank's start until the slowest rank has the answer
                     "after_latest_start": C.summary([max(e for e, _ in r) - max(l for _, l in r) for r in rounds]),
                     # per round: the slowest rank's time from the common instant, and the latest rank's lag
                     "samples": slowest, "lags": [max(l for _, l in r) for r in rounds]},
            "per_call": C.summary(pooled[path]),
            "round_period": sum(periods[path]) / len(periods[path]),
        }
    return out


def agreement_parser(description: str, rounds: int, warmup: int) -> argparse.ArgumentParser:
    """The options every agreement benchmark takes (this one and bench/agree_page.py)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--backend", choices=["host", "cuda"], default="host")
    parser.add_argument("--ranks", default="2,4,8")
    parser.add_argument("--rounds", type=int, default=rounds, help="back-to-back rounds per path and N")
    parser.add_argument("--blocks", type=int, default=10, help="alternating blocks the rounds are split into")
    parser.add_argument("--sync-rounds", type=int, default=400, help="synchronized rounds per path and N")
    parser.add_argument("--lead", type=float, default=0.004, help="seconds from the barrier to each common start")
    parser.add_argument("--pin", action="store_true", help="pin each worker to cores of its own "
                        "(an equal share of this process's cores), for both paths, each spinning the last "
                        f"{C.PINNED_SPIN_S * 1e3:g} ms before every common start")
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", default=None)
    return parser


def sync_rows(info: dict, path: str) -> list[list]:
    """The synchronized-rounds table: ``path`` against gloo, p50 and p99, with their ratios."""
    rows = []
    for n, r in info["by_n"].items():
        p, g = r[path]["sync"], r["gloo"]["sync"]
        rows.append([n, C.ms(p["p50"]), C.ms(p["p99"]), C.ms(g["p50"]), C.ms(g["p99"]),
                     C.ratio(p["p50"], g["p50"]), C.ratio(p["p99"], g["p99"]), C.ms(p["start_lag_p50"]),
                     C.ratio(p["after_latest_start"]["p99"], g["after_latest_start"]["p99"])])
    return rows


#: sync_rows' columns: how late the latest rank left the common instant (in every path's time), and the
#: p99 ratio with that lag taken out of each round (the round alone, from the latest rank's start)
SYNC_COLUMNS = ["p50", "p99", "gloo p50", "p99", "ratio p50", "ratio p99", "latest start p50",
                "ratio p99 from latest start"]


def main() -> None:
    args = agreement_parser(__doc__.split("\n\n")[0], rounds=2000, warmup=50).parse_args()

    info = {"bench": "agree_latency", "machine": C.machine(), "backend": args.backend,
            "command": C.command_line(), "rounds": args.rounds, "start_spin_s": C.spin_s(args.pin), "by_n": {}}
    C.measure_each_n(f"agree_latency-{args.backend}", info, args, measure)

    rows, rows2 = sync_rows(info, "peerd"), []
    for n, r in info["by_n"].items():
        p, g = r["peerd"], r["gloo"]
        rows2.append([n, C.ms(p["round_period"]), C.ms(g["round_period"]),
                      C.ratio(p["round_period"], g["round_period"]),
                      C.ms(p["per_call"]["p50"]), C.ms(p["per_call"]["p99"]),
                      C.ms(g["per_call"]["p50"]), C.ms(g["per_call"]["p99"])])
    print(f"\nagreement latency, synchronized rounds, ms ({args.backend}, {args.sync_rounds} rounds per path; "
          "from the common start until the slowest rank has the answer; ratio = peerd / gloo)")
    print(C.table(["N", *SYNC_COLUMNS], rows))
    print(f"\nback-to-back rounds, ms ({args.rounds} rounds per path)")
    print(C.table(["N", "peerd period", "gloo period", "ratio", "peerd call p50", "p99",
                   "gloo call p50", "p99"], rows2))
    C.save(f"agree_latency-{args.backend}", info, args.out)


if __name__ == "__main__":
    main()
