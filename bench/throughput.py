"""Throughput and scale: agreement votes/s and join+release cycles/s with many groups.

    python bench/throughput.py                         # G = 1, 16, 64, 256; RSS over 100,000 cycles
    python bench/throughput.py --groups 1,256 --rss-cycles 0

--npes client processes (default 2), one per rank: process r is rank r of
every one of G concurrent groups. peerd_client holds one connection per
process and one call at a time, so each process drives its G groups through
a raw ZeroMQ DEALER speaking peerd.protocol, one request in flight per
group and at most CLIENT_WINDOW (32) per process (more, and the daemon
drops replies to a connection that falls behind, by design): the daemon sees G groups each with npes members, every member's pid
the kernel's (the daemon identifies ranks by it).

  votes       each group runs back-to-back tp_agree rounds ("agree" op);
              a vote is one rank's answered call: votes/s = calls/s summed
              over processes (rounds/s = votes/s / npes).
  cycles      each group runs what a PeerBuffer's life asks of the daemon:
              join (the reply waits for every rank), commit, release; a
              cycle is one rank's join+commit+release, cycles/s summed over
              processes (buffer sets/s = cycles/s / npes).
  seed votes  the same ranks with G gloo groups (new_group), each round an
              async all_reduce(MIN) on every group, then a wait on all.
  seed cycles the seed's warm handshake (allocate, all_gather_object, open,
              all_reduce) + unmap + free per group, the groups in turn
              (gloo collectives are blocking: no concurrency to exploit).

Then the daemon's RSS (VmRSS) is read before and after --rss-cycles cycles
(default 100,000) over --rss-groups groups.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402


def drive(rank: int, npes: int, groups: int, per_group: int, mode: str, prefix: str) -> int:
    """Run ``per_group`` votes or cycles on each of ``groups`` groups; the calls answered."""
    import zmq

    from peerd.paths import endpoint
    from peerd.protocol import decode_reply, encode_request
    from peerd.routingids import new_routing_id
    from peerd.server import CLIENT_WINDOW

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, new_routing_id())
    sock.connect(endpoint(os.environ["PEERD_SOCKET"]))
    ids = itertools.count(1)
    pending: dict[int, tuple[int, str]] = {}  # request id -> (group, op)
    left = [per_group] * groups
    keys = [f"{prefix}-{g}" for g in range(groups)]
    slot = {"name": "tput", "rank": rank}

    backlog: list[tuple[int, str]] = []  # past the window: sent as replies come

    def send(g: int, op: str) -> None:
        if len(pending) >= CLIENT_WINDOW:  # past it, the daemon may drop replies: Note [Reply window]
            backlog.append((g, op))
            return
        rid = next(ids)
        if op == "agree":
            body = {"group": keys[g], "rank": rank, "npes": npes, "ok": True, "timeout": None}
        elif op == "join":
            body = {**slot, "group": keys[g], "npes": npes, "nbytes": 4096, "device": "host", "flags": 0,
                    "timeout": None}
        elif op == "commit":
            body = {**slot, "group": keys[g], "ok": True, "reason": "", "timeout": None}
        else:
            body = {**slot, "group": keys[g]}
        pending[rid] = (g, op)
        sock.send(encode_request(rid, op, body))

    first = "agree" if mode == "votes" else "join"
    nxt = {"join": "commit", "commit": "release", "release": "join"}
    for g in range(groups):
        send(g, first)
    answered = 0
    while pending:
        if not sock.poll(60_000):
            raise RuntimeError(f"no reply within 60s ({len(pending)} pending)")
        reply = decode_reply(sock.recv())
        g, op = pending.pop(reply.id)
        if backlog:
            send(*backlog.pop(0))
        if not reply.ok:
            raise RuntimeError(f"{op} on {keys[g]} failed: {reply.error}")
        answered += 1
        if op == "agree":
            if not reply.body["ok"]:
                raise RuntimeError(f"round on {keys[g]} returned False: {reply.body}")
            left[g] -= 1
            if left[g]:
                send(g, "agree")
        elif op == "release":
            left[g] -= 1
            if left[g]:
                send(g, "join")
        else:
            send(g, nxt[op])
    sock.close(0)
    return answered


def seed_drive(rank, npes, gloo_groups, per_group, mode, memory) -> int:
    import torch
    import torch.distributed as dist

    done = 0
    if mode == "votes":
        flags = [torch.ones(1, dtype=torch.int32) for _ in gloo_groups]
        for _ in range(per_group):
            works = [dist.all_reduce(f, op=dist.ReduceOp.MIN, group=pg, async_op=True)
                     for f, pg in zip(flags, gloo_groups)]
            for w in works:
                w.wait()
            done += len(works)
        return done
    serial = itertools.count()
    for _ in range(per_group):
        for pg in gloo_groups:
            buf = C.SeedBuffer(memory, 4096, rank, npes, f"t{next(serial)}", group=pg)
            buf.unmap()
            buf.free()
            done += 1
    return done


def worker(rank, npes, port, plan, start: C.Start, results) -> None:
    """Runs every step of ``plan`` in order: (label, path, mode, groups, per_group)."""
    try:
        import torch
        import torch.distributed as dist

        max_seed_groups = max([g for _, path, _, g, _ in plan if path == "seed"], default=0)
        gloo_groups = []
        if max_seed_groups:
            C.init_gloo(port, rank, npes)
            gloo_groups = [dist.new_group(list(range(npes)), backend="gloo") for _ in range(max_seed_groups)]
        memory = C.HostSeedMemory(torch.device("cpu"))
        for label, path, mode, groups, per_group in plan:
            instant, _ = start.wait(rank)
            if path == "peerd":
                answered = drive(rank, npes, groups, per_group, mode, label)
            else:
                answered = seed_drive(rank, npes, gloo_groups[:groups], per_group, mode, memory)
            results.put((label, rank, time.monotonic() - instant, answered, None))
        if max_seed_groups:
            dist.destroy_process_group()
    except BaseException:
        results.put(("error", rank, 0.0, 0, traceback.format_exc()))
        raise


def run_plan(npes: int, plan: list, timeout: float, daemon: C.Daemon, rss_at: dict | None = None) -> dict:
    ctx = mp.get_context("spawn")
    start = C.Start(ctx, npes, lead=0.05)
    results = ctx.Queue()
    (port,) = C.free_ports(1)
    procs = [ctx.Process(target=worker, args=(r, npes, port, plan, start, results)) for r in range(npes)]
    for p in procs:
        p.start()
    out: dict = {}
    try:
        for _ in range(len(plan) * npes):
            label, rank, elapsed, answered, error = results.get(timeout=timeout)
            if error:
                raise RuntimeError(f"rank {rank} failed:\n{error}")
            entry = out.setdefault(label, {"elapsed": 0.0, "answered": 0, "ranks": 0})
            entry["elapsed"] = max(entry["elapsed"], elapsed)
            entry["answered"] += answered
            entry["ranks"] += 1
            if entry["ranks"] == npes:
                print(f"  {label}: {entry['answered']} in {entry['elapsed']:.2f}s", flush=True)
                if rss_at is not None:
                    rss_at[label] = daemon.rss()
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--npes", type=int, default=2, help="ranks per group (= client processes)")
    parser.add_argument("--groups", default="1,16,64,256", help="concurrent groups, comma-separated")
    parser.add_argument("--votes", type=int, default=10000, help="votes per process per measurement")
    parser.add_argument("--cycles", type=int, default=4000, help="cycles per process per measurement")
    parser.add_argument("--seed-votes", type=int, default=4000)
    parser.add_argument("--seed-cycles", type=int, default=300)
    parser.add_argument("--rss-cycles", type=int, default=100_000, help="rank cycles for the RSS check (0: skip)")
    parser.add_argument("--rss-groups", type=int, default=64)
    parser.add_argument("--daemon-log-level", default="info", help="the daemon's --log-level (its default: info)")
    parser.add_argument("--daemon-arg", action="append", default=[],
                        help="extra `peerd serve` argument, repeatable (e.g. --daemon-arg=--agreement-timeout=2)")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    sizes = C.parse_ints(args.groups)
    npes = args.npes

    plan = []
    for g in sizes:
        plan.append((f"votes-peerd-{g}", "peerd", "votes", g, max(1, args.votes // g)))
        plan.append((f"votes-seed-{g}", "seed", "votes", g, max(1, args.seed_votes // g)))
        plan.append((f"cycles-peerd-{g}", "peerd", "cycles", g, max(1, args.cycles // g)))
        plan.append((f"cycles-seed-{g}", "seed", "cycles", g, max(1, args.seed_cycles // g)))

    info = {"bench": "throughput", "machine": C.machine(), "backend": "host", "command": C.command_line(),
            "npes": npes, "by_groups": {}}
    info["daemon_log_level"] = args.daemon_log_level
    info["daemon_args"] = args.daemon_arg
    with C.Daemon("host", log_level=args.daemon_log_level, args=tuple(args.daemon_arg)) as daemon:
        info["rss_start"] = daemon.rss()
        got = run_plan(npes, plan, args.timeout, daemon)
        for g in sizes:
            row = {}
            for kind in ("votes", "cycles"):
                for path in ("peerd", "seed"):
                    e = got[f"{kind}-{path}-{g}"]
                    row[f"{kind}_{path}"] = e["answered"] / e["elapsed"] / (1 if kind == "votes" or path == "seed"
                                                                             else 3)
            info["by_groups"][str(g)] = row
        if args.rss_cycles:
            per_group = max(1, args.rss_cycles // npes // args.rss_groups)
            rss = {"before": daemon.rss()}
            label = "rss-cycles"
            got = run_plan(npes, [(label, "peerd", "cycles", args.rss_groups, per_group)], args.timeout, daemon, rss)
            e = got[label]
            rss["after"] = rss.pop(label)
            status = daemon.call("status")
            info["rss"] = {**rss, "cycles": e["answered"] // 3, "groups": args.rss_groups,
                           "cycles_per_s": e["answered"] / 3 / e["elapsed"], "elapsed": e["elapsed"],
                           "groups_left": status["groups"], "agreements_left": status["agreements_pending"]}
        info["daemon_exit"] = daemon.stop()

    rows = []
    for g, r in info["by_groups"].items():
        rows.append([g, f"{r['votes_peerd']:,.0f}", f"{r['votes_seed']:,.0f}", C.ratio(r["votes_peerd"], r["votes_seed"]),
                     f"{r['cycles_peerd']:,.0f}", f"{r['cycles_seed']:,.0f}",
                     C.ratio(r["cycles_peerd"], r["cycles_seed"])])
    print(f"\nthroughput ({npes} ranks per group, one process per rank; per-rank counts; ratio = peerd / seed; "
          f"daemon --log-level {args.daemon_log_level})")
    print(C.table(["groups", "votes/s peerd", "votes/s gloo", "ratio", "join+release/s peerd",
                   "setup+free/s seed", "ratio"], rows))
    if "rss" in info:
        r = info["rss"]
        print(f"\ndaemon RSS: {r['before'] / C.MiB:.1f} MiB before, {r['after'] / C.MiB:.1f} MiB after "
              f"{r['cycles']:,} join+commit+release cycles over {r['groups']} groups "
              f"({r['cycles_per_s']:,.0f}/s; {r['after'] / r['before']:.2f}x; fresh daemon: "
              f"{info['rss_start'] / C.MiB:.1f} MiB); sets left {r['groups_left']}, agreements left "
              f"{r['agreements_left']}")
    C.save("throughput-host", info, args.out)


if __name__ == "__main__":
    main()
