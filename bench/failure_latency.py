"""Failure latency: from SIGKILL of one rank until every other rank has raised.

    python bench/failure_latency.py                      # N = 4, host backend
    python bench/failure_latency.py --ranks 8 --seed-timeout 30 --repeats 5

N worker processes (spawn); the last rank is the victim. Two moments to die:

  handshake   the victim has joined (peerd) / allocated (seed) and stalls
              before opening its peers' handles; the others wait in the
              constructor (peerd: in the commit vote; seed: in
              all_gather_object)
  agreement   every rank holds its buffer set; the others wait in tp_agree
              (peerd) / all_reduce(MIN) (seed), the victim never comes

Each survivor reports, just before the call it will wait in, that it is
about to wait; once all did, the parent waits --settle seconds, SIGKILLs the
victim and records the instant. A survivor's latency is the time from the
kill until its call raised (peerd: MonoUnsupported; tp_agree returns False
instead, which counts the same) — or until the seed's process-group timeout
(--seed-timeout, set on init_process_group) expired. Survivors that have
raised stay alive (as a worker that caught the error would) until every
survivor reported or the timeout passed, so a peer's own exit never wakes
another. The table gives, per path and moment, the median over repeats of
the slowest survivor, the fastest survivor, and how the survivors failed.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue as _queue
import signal
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

NBYTES = 1 << 16


def _say_first(owner, name: str, say) -> None:
    """Make ``owner.name`` call ``say()`` before it runs (a method, or a module's function)."""
    real = getattr(owner, name)

    def said(*args, **kwargs):
        say()
        return real(*args, **kwargs)

    setattr(owner, name, said)


def worker(path, moment, rank, npes, victim, port, seed_timeout, events, done, group) -> None:
    """One rank of one trial; reports ('ready'|'waiting'|'result', rank, ...) on ``events``."""
    try:
        import torch.distributed as dist

        def about_to_wait():
            events.put(("waiting", rank, os.getpid(), None))

        def stall():
            events.put(("ready", rank, os.getpid(), None))
            time.sleep(3600)

        if path == "peerd":
            import peerd_client.buffer as buffer_module
            import peerd_client.agree as agree_module
            from peerd_client import MonoUnsupported, PeerBuffer, tp_agree
            from peerd_client.connection import connection

            conn = connection()
            real_call = conn.call

            def call(op, body, **kw):  # say "waiting" as the call that will wait goes out
                if op == moment_op:
                    about_to_wait()
                return real_call(op, body, **kw)

            moment_op = "commit" if moment == "handshake" else "agree"
            conn.call = call
            if moment == "handshake":  # the same wait on the group's control page, where it has one
                _say_first(buffer_module.PeerBuffer, "_commit_on_page", about_to_wait)
            else:
                _say_first(agree_module, "_round_on_page", about_to_wait)
            if rank == victim and moment == "handshake":
                buffer_module.mappings.open = lambda *a: stall()
            try:
                import torch

                # the host backend's device, also where torch sees a GPU (the daemon here is --backend host)
                buf = PeerBuffer(NBYTES, group, rank, npes, torch.device("cpu"))
                if rank == victim:
                    stall()
                ok = tp_agree(True, group)
                outcome = "tp_agree returned True" if ok else "tp_agree returned False"
                message = ""
            except MonoUnsupported as err:
                outcome, message = "raised MonoUnsupported" + (f" {err.code}" if err.code else ""), str(err)
        else:
            C.init_gloo(port, rank, npes, timeout_s=seed_timeout)
            import torch

            memory = C.HostSeedMemory(torch.device("cpu"))

            flag = torch.ones(1, dtype=torch.int32)
            dist.all_reduce(flag)  # the group is up and connected
            try:
                if moment == "handshake":
                    if rank == victim:
                        memory.alloc(NBYTES, f"fail-{os.getpid()}")
                        stall()
                    about_to_wait()
                    buf = C.SeedBuffer(memory, NBYTES, rank, npes, f"fail-{os.getpid()}")
                else:
                    buf = C.SeedBuffer(memory, NBYTES, rank, npes, f"fail-{os.getpid()}")
                    if rank == victim:
                        stall()
                    about_to_wait()
                    flag.fill_(1)
                    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
                outcome, message = "returned", ""
            except Exception as err:
                message = str(err)
                low = message.lower()
                kind = "timed out" if "timed out" in low or "timeout" in low else \
                    "peer connection lost" if "connection closed" in low or "connection reset" in low \
                    else type(err).__name__
                outcome = f"raised ({kind})"
        events.put(("result", rank, time.monotonic(), (outcome, message[:300])))
        done.wait(600)  # stay alive like a worker that caught the error
        for name in os.listdir(C.SHM_DIR):  # this rank's seed segment
            if name.startswith(f"pbseed-{os.getpid()}-"):
                os.unlink(os.path.join(C.SHM_DIR, name))
        os._exit(0)
    except BaseException:
        events.put(("error", rank, traceback.format_exc(), ""))
        os._exit(1)


def _idle_worker(events) -> None:
    """A worker like the others (torch and the client loaded, connected), doing nothing."""
    import torch  # noqa: F401

    from peerd_client.connection import connection

    connection()
    events.put(("ready", 0, os.getpid(), None))
    time.sleep(3600)


def floor(repeats: int) -> list[float]:
    """Seconds from SIGKILL of such a worker until its pidfd turns readable: the kernel's share.

    A process with torch mapped takes tens of milliseconds to tear down its
    address space, and only then closes its sockets and signals its pidfd:
    no path can see the death sooner.
    """
    import select

    ctx = mp.get_context("spawn")
    out = []
    for _ in range(repeats):
        events = ctx.Queue()
        p = ctx.Process(target=_idle_worker, args=(events,))
        p.start()
        _, _, pid, _ = events.get(timeout=120)
        fd = os.pidfd_open(pid)
        time.sleep(0.1)
        t = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        select.select([fd], [], [], 10)
        out.append(time.monotonic() - t)
        os.close(fd)
        p.join()
    return out


def trial(path: str, moment: str, npes: int, args, serial: int) -> dict:
    ctx = mp.get_context("spawn")
    events, done = ctx.Queue(), ctx.Event()
    (port,) = C.free_ports(1)
    victim = npes - 1
    group = f"fail-{moment}-{serial}"
    procs = [ctx.Process(target=worker, args=(path, moment, r, npes, victim, port, args.seed_timeout, events,
                                              done, group)) for r in range(npes)]
    for p in procs:
        p.start()
    waiting, ready, results = set(), None, {}
    killed_at = None
    deadline = time.monotonic() + 120
    try:
        while True:
            if killed_at is None and ready is not None and len(waiting) == npes - 1:
                time.sleep(args.settle)
                killed_at = time.monotonic()
                os.kill(ready, signal.SIGKILL)
                deadline = killed_at + (args.seed_timeout + 10 if path == "seed" else 30)
            if len(results) == npes - 1:
                break
            try:
                kind, rank, a, b = events.get(timeout=max(0.01, deadline - time.monotonic()))
            except _queue.Empty:
                break
            if kind == "ready":
                ready = a
            elif kind == "waiting":
                waiting.add(rank)
            elif kind == "result":
                results[rank] = (a, b)
            elif kind == "error":
                raise RuntimeError(f"{path}/{moment} rank {rank} failed:\n{a}")
    finally:
        done.set()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        if ready is not None:  # the victim's seed segment: it died holding it
            for name in os.listdir(C.SHM_DIR):
                if name.startswith(f"pbseed-{ready}-"):
                    os.unlink(os.path.join(C.SHM_DIR, name))
    if killed_at is None:
        raise RuntimeError(f"{path}/{moment}: the victim was never killed (waiting={sorted(waiting)}, "
                           f"results={results})")
    latencies = {r: t - killed_at for r, (t, _) in results.items()}
    never = [r for r in range(npes - 1) if r not in results]
    return {
        "latencies": latencies,
        "outcomes": {r: o[0] for r, (_, o) in results.items()},
        "messages": {r: o[1] for r, (_, o) in results.items()},
        "never": never,
        "slowest": max(latencies.values()) if not never else float("inf"),
        "fastest": min(latencies.values()) if latencies else float("inf"),
    }


def describe(outcomes: list[str]) -> str:
    counts = {}
    for o in outcomes:
        counts[o] = counts.get(o, 0) + 1
    return ", ".join(f"{n}x {o}" for o, n in sorted(counts.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5, help="trials per peerd row")
    parser.add_argument("--seed-repeats", type=int, default=2, help="trials per seed row (each may last the timeout)")
    parser.add_argument("--seed-timeout", type=float, default=10.0,
                        help="the seed's process-group timeout, seconds (torch's default for gloo is 1800)")
    parser.add_argument("--settle", type=float, default=0.1, help="seconds between 'all waiting' and the kill")
    parser.add_argument("--moments", default="handshake,agreement")
    parser.add_argument("--paths", default="peerd,seed")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    info = {"bench": "failure_latency", "machine": C.machine(), "backend": "host", "command": C.command_line(),
            "npes": args.ranks, "seed_timeout": args.seed_timeout, "rows": {}}
    serial = 0
    with C.Daemon("host") as daemon:
        info["floor"] = floor(args.repeats)
        print("kernel floor (SIGKILL to pidfd readable): "
              + ", ".join(f"{t * 1e3:.1f} ms" for t in info["floor"]), flush=True)
        for moment in args.moments.split(","):
            for path in args.paths.split(","):
                trials = []
                for _ in range(args.repeats if path == "peerd" else args.seed_repeats):
                    serial += 1
                    trials.append(trial(path, moment, args.ranks, args, serial))
                info["rows"][f"{path}/{moment}"] = trials
                print(f"{path}/{moment}: slowest survivor "
                      + ", ".join(f"{t['slowest'] * 1e3:.1f} ms" for t in trials), flush=True)
        info["daemon_exit"] = daemon.stop()

    fl = info["floor"]
    rows = [["-", "kernel floor: SIGKILL to pidfd readable", C.ms(C.quantile(fl, 0.5)), "", C.ms(max(fl)), ""]]
    for moment in args.moments.split(","):
        med = {}
        for path in args.paths.split(","):
            trials = info["rows"][f"{path}/{moment}"]
            med[path] = C.quantile([t["slowest"] for t in trials], 0.5)
            rows.append([moment, path if path == "peerd" else f"seed (timeout {args.seed_timeout:g}s)",
                         C.ms(med[path]), C.ms(C.quantile([t["fastest"] for t in trials], 0.5)),
                         C.ms(max(t["slowest"] for t in trials)),
                         describe([o for t in trials for o in t["outcomes"].values()])
                         + (f"; {sum(len(t['never']) for t in trials)} never returned" if any(t["never"] for t in trials) else "")])
        if len(med) == 2:
            rows.append([moment, "ratio peerd / seed", f"{med['peerd'] / med['seed']:.4f}", "", "", ""])
    print(f"\nfailure latency, ms: SIGKILL of rank {args.ranks - 1} of {args.ranks} until every survivor raised "
          f"(median over trials of the slowest survivor)")
    print(C.table(["moment", "path", "every peer", "first peer", "worst trial", "how the survivors failed"], rows))
    C.save("failure_latency-host", info, args.out)


if __name__ == "__main__":
    main()
