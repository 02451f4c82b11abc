"""Setup latency: from a common start until every rank holds a usable PeerBuffer.

    python bench/setup_latency.py --backend host            # or --backend cuda on a GPU machine
    python bench/setup_latency.py --ranks 2,4,8 --iters 20 --nbytes 1048576
    python bench/setup_latency.py --backend cuda --ranks 2,8 --iters 50   # the arena targets (issue 17)

For each N, N worker processes (spawn) sleep until one common instant, then
build a peer buffer set; a sample is the time from that instant until the
slowest rank holds it (joined, every handle opened, agreed, views built).
Paths, measured in the same run, alternating iteration by iteration:

  cold phase (no process group, no daemon connection before the start):
    peerd first use   PeerBuffer(...) in a process made fresh to peerd before
                      each start: its daemon connection dropped and the arena
                      chunks it kept mapped unmapped (connect + hello + one
                      open per chunk are inside the time)
    seed cold         init_process_group("gloo", tcp://) + allocate +
                      all_gather_object the handles + open the peers' +
                      all_reduce(MIN)
  warm phase (the gloo group is up, the daemon connection open, the
  uid's chunk mapped by the previous iteration):
    peerd             PeerBuffer(...)
    seed warm         allocate + all_gather_object + open + all_reduce(MIN)

Teardown (close, destroy_process_group) happens after every rank recorded
its time and is not measured. Prints p50 / p90 in ms and the ratios
peerd / seed; writes the samples as JSON (bench/results/ by default).

``--timeline`` runs the daemon under bench/_daemon_timeline.py and adds
its side of each peerd path's joins: when it began the first and the last,
when it was done with the last (the set opened there, unless the backend
was still reserving its memory), when the replies were out, and the CPU a
join took.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

COLD = ("peerd first use", "seed cold")
WARM = ("peerd", "peerd next set", "seed warm")
#: "peerd next set": another buffer set of a group this process already holds one of (a new name),
#: as an engine makes its signal pads and then its data buffers; "peerd": a new group every time


def set_of(path: str, npes: int, i: int) -> tuple[str, str]:
    """The group and name of a peerd path's set in iteration ``i``: a new group each time, or the
    next set of one group."""
    if path == "peerd next set":
        return f"setup-{npes}-next", f"set-{i}"
    return f"setup-{npes}-{path.replace(' ', '')}-{i}", "default"


def worker(rank, npes, args, start: C.Start, ports, results) -> None:
    try:
        import torch.distributed as dist

        from peerd_client import PeerBuffer
        from peerd_client.connection import connection

        from peerd_client.connection import Connection

        device = C.torch_device(args.backend)
        memory = C.seed_memory(args.backend, device)
        connection()  # import and warm the client once; the cold phase drops it before each start
        samples = []
        marks: dict = {}
        real_call = Connection.call

        def call(self, op, body, **kw):  # phase marks: when each request went out and came back
            marks[f"{op} sent"] = time.monotonic()
            try:
                return real_call(self, op, body, **kw)
            finally:
                marks[f"{op} answered"] = time.monotonic()

        Connection.call = call
        from peerd_client import pagelink

        def timed(owner, name, mark, method=False):  # the steps between the join's answer and the verdict
            real = getattr(owner, name)

            def step(*a, **kw):
                try:
                    return real(*a, **kw)
                finally:
                    marks[mark] = time.monotonic()
            setattr(owner, name, staticmethod(step) if isinstance(owner, type) and not method else step)

        from peerd_client.mappings import mappings

        timed(Connection, "__init__", "connected and greeted", method=True)
        timed(mappings, "open", "chunk mapped", method=True)  # the last one of the set's
        timed(pagelink, "ask_area", "page area asked")  # before the chunks open; read after them
        timed(pagelink.Area, "attach", "page mapped")
        timed(pagelink, "_DaemonWatch", "daemon watched")
        timed(PeerBuffer, "_view", "views built", method=True)
        timed(pagelink.GroupLink, "commit", "commit voted on the page", method=True)
        timed(pagelink.GroupLink, "attach", "page attached", method=True)
        import peerd_client.buffer as buffer_module  # the steps before the join leaves

        timed(buffer_module, "connection", "connection got")
        timed(buffer_module, "resolve", "group resolved")
        timed(PeerBuffer, "_take_part", "device identified", method=True)
        timed(pagelink.GroupLink, "__init__", "link made", method=True)

        def record(path, i, instant, late):
            done = time.monotonic()
            phases = {k: v - instant for k, v in marks.items()}
            samples.append((path, i, done - instant, late, phases, instant))
            marks.clear()

        def run_peerd(path, i):
            key, name = set_of(path, npes, i)
            instant, late = start.wait(rank)
            marks.clear()
            buf = PeerBuffer(args.nbytes, key, rank, npes, device, name=name)
            record(path, i, instant, late)
            buf.abort_address  # the page area's GPU registration, which the first all-reduce pays, not the setup
            samples[-1][4]["abort_address read (after done)"] = time.monotonic() - instant
            start.barrier.wait()  # every rank holds it before anyone closes
            buf.close()

        def run_seed(path, i, cold):
            tag = f"{npes}-{i}-{int(cold)}"
            instant, late = start.wait(rank)
            marks.clear()
            if cold:
                C.init_gloo(ports[i], rank, npes)
                marks["process group up"] = time.monotonic()
            buf = C.SeedBuffer(memory, args.nbytes, rank, npes, tag, marks=marks)
            record(path, i, instant, late)
            buf.unmap()
            start.barrier.wait()  # nobody frees under a peer that still maps it
            buf.free()
            if cold:
                dist.destroy_process_group()

        for i in range(args.warmup + args.iters):
            order = COLD if i % 2 == 0 else COLD[::-1]
            for path in order:
                if path == "peerd first use":
                    C.reset_peerd_connection()
                    run_peerd(path, i)
                else:
                    run_seed(path, i, cold=True)
        C.init_gloo(ports[-1], rank, npes)
        for i in range(args.warmup + args.iters):
            order = WARM if i % 2 == 0 else WARM[::-1]
            for path in order:
                run_seed(path, i, cold=False) if path == "seed warm" else run_peerd(path, i)
        dist.destroy_process_group()
        results.put((rank, samples, None))
    except BaseException:
        results.put((rank, [], traceback.format_exc()))
        raise


def measure(npes: int, args) -> dict:
    ctx = mp.get_context("spawn")
    start = C.Start(ctx, npes, lead=args.lead)
    results = ctx.Queue()
    ports = C.free_ports(args.warmup + args.iters + 1)
    procs = [ctx.Process(target=worker, args=(r, npes, args, start, ports, results)) for r in range(npes)]
    for p in procs:
        p.start()
    got = {}
    deadline = time.monotonic() + args.timeout
    while len(got) < npes:
        try:
            rank, samples, error = results.get(timeout=max(1.0, deadline - time.monotonic()))
        except Exception:
            raise RuntimeError(f"N={npes}: workers did not finish within {args.timeout}s")
        if error:
            for p in procs:
                p.kill()
            raise RuntimeError(f"N={npes} rank {rank} failed:\n{error}")
        got[rank] = samples
    for p in procs:
        p.join(30)
    # a sample: the slowest rank's time for one path and iteration (warm-up iterations dropped)
    per, late, phases, instants = {}, {}, {}, {}
    for samples in got.values():
        for path, i, elapsed, lag, marks, instant in samples:
            if i < args.warmup:
                continue
            instants.setdefault(path, {})[i] = instant
            per.setdefault(path, {}).setdefault(i, []).append(elapsed)
            late[path] = max(late.get(path, 0.0), lag)
            for what, t in marks.items():  # the slowest rank's mark, per iteration
                slot = phases.setdefault(path, {}).setdefault(what, {})
                slot[i] = max(slot.get(i, 0.0), t)
    out = {}
    for path, by_iter in per.items():
        slowest = [max(v) for v in by_iter.values()]
        out[path] = {**C.summary(slowest), "samples": slowest, "max_start_lag": late[path],
                     "instants": instants[path],  # the common start of each iteration: --timeline lines up by it
                     "phases_p50": {what: C.quantile(list(v.values()), 0.5)
                                    for what, v in sorted(phases.get(path, {}).items(), key=lambda kv: C.quantile(list(kv[1].values()), 0.5))}}
    return out


def daemon_side(info: dict, timeline: str) -> dict:
    """Per N and peerd path, p50 over iterations of the daemon's side of the joins (ms from the common
    start; CPU in ms): rows from bench/_daemon_timeline.py, matched to a set by its group and name."""
    rows = [json.loads(line) for line in open(timeline)]
    joins: dict = {}
    for n, row in enumerate(rows):  # ("handle", op, group, name, rank, began, ended, cpu)
        if row[0] == "handle" and row[1] == "join":
            joins.setdefault((row[2], row[3]), []).append(n)
    side: dict = {}
    for npes, paths in info["by_n"].items():
        for path in ("peerd first use", "peerd", "peerd next set"):
            marks: dict = {}
            for i, instant in paths[path]["instants"].items():
                at = joins.get(set_of(path, int(npes), int(i)), [])
                if len(at) != int(npes):
                    continue
                first, last = rows[at[0]], rows[at[-1]]
                # the replies: the first batch of npes or more sent after the last join (there, or once the
                # backend had the memory ready: peerd.rendezvous memory_ready)
                sent = next((r for r in rows[at[-1] + 1:] if r[0] == "deliver" and r[1] >= int(npes)), None)
                for what, t in (("began the first join", first[5] - instant),
                                ("began the last join", last[5] - instant),
                                ("done with the last join", last[6] - instant),
                                ("replies sent", sent[3] - instant if sent else None),
                                ("CPU of a join but the last", sum(rows[k][7] for k in at[:-1]) / (len(at) - 1)
                                 if len(at) > 1 else None),
                                ("CPU of the last join (opens the set)", last[7])):
                    if t is not None:
                        marks.setdefault(what, []).append(t)
            side.setdefault(npes, {})[path] = {what: C.quantile(v, 0.5) for what, v in marks.items()}
    return side


def main() -> None:
    parser = C.setup_parser(__doc__, ranks="2,4,8", iters=20, warmup=2, lead=0.03, timeout=900,
                            nbytes_help="bytes per rank (default 1 MiB host, 2 MiB cuda)")
    parser.add_argument("--timeline", action="store_true", help="the daemon's side of the joins, too")
    args = parser.parse_args()
    args.nbytes = args.nbytes or (2 * C.MiB if args.backend == "cuda" else C.MiB)
    if args.timeline:
        args.timeline_file = os.path.join(tempfile.mkdtemp(prefix="pb-timeline-"), "daemon.jsonl")

    info = {"bench": "setup_latency", "machine": C.machine(), "backend": args.backend,
            "command": C.command_line(), "nbytes": args.nbytes, "iters": args.iters, "by_n": {}}
    C.measure_each_n(f"setup_latency-{args.backend}", info, args, measure)
    left = C.leftover_seed_segments()
    if left:
        print(f"warning: seed segments left in /dev/shm: {left[:5]}")

    rows = []
    for n, paths in info["by_n"].items():
        pf, sc, pw, pn, sw = (paths[k] for k in ("peerd first use", "seed cold", "peerd", "peerd next set",
                                                  "seed warm"))
        rows.append([n, C.ms(pf["p50"]), C.ms(pf["p90"]), C.ms(sc["p50"]), C.ms(sc["p90"]),
                     C.ratio(pf["p50"], sc["p50"]),
                     C.ms(pw["p50"]), C.ms(pw["p90"]), C.ms(pn["p50"]), C.ms(pn["p90"]), C.ms(sw["p50"]),
                     C.ms(sw["p90"]), C.ratio(pw["p50"], sw["p50"]), C.ratio(pn["p50"], sw["p50"])])
    header = ["N", "peerd 1st p50", "p90", "seed cold p50", "p90", "ratio p50",
              "peerd p50", "p90", "next set p50", "p90", "seed warm p50", "p90", "ratio p50", "next set ratio"]
    print(f"\nsetup latency, ms ({args.backend} backend, {args.nbytes} B/rank, {args.iters} iters; "
          f"ratio = peerd / seed)")
    print(C.table(header, rows))
    n = list(info["by_n"])[-1]
    print(f"\nwhere the time goes at N={n}: p50 over iterations of the slowest rank's instant, ms from the start")
    for path, r in info["by_n"][n].items():
        print(f"  {path:16s} " + ", ".join(f"{what} {C.ms(t)}" for what, t in r["phases_p50"].items())
              + f", done {C.ms(r['p50'])}")
    if args.timeline:
        info["daemon_p50"] = daemon_side(info, args.timeline_file)
        shutil.rmtree(os.path.dirname(args.timeline_file))
        print(f"\nthe daemon's side at N={n} (bench/_daemon_timeline.py): p50 over iterations, ms from the start")
        for path, r in info["daemon_p50"][n].items():
            print(f"  {path:16s} " + ", ".join(f"{what} {C.ms(t)}" for what, t in r.items()))
    print("\ntargets (issue 17): warm p50 <= 1.0 ms and <= 0.1x the seed's warm exchange at 8 ranks; "
          "first use <= 3 ms plus one open per chunk")
    for n, paths in info["by_n"].items():
        seed = paths["seed warm"]["p50"]
        print(f"  N={n}: warm {C.ms(paths['peerd']['p50'])} ms = {C.ratio(paths['peerd']['p50'], seed)} x seed warm "
              f"(a group's next set {C.ms(paths['peerd next set']['p50'])} ms = "
              f"{C.ratio(paths['peerd next set']['p50'], seed)} x); first use {C.ms(paths['peerd first use']['p50'])} ms")
    C.save(f"setup_latency-{args.backend}", info, args.out)


if __name__ == "__main__":
    main()
