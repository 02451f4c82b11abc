"""tp_agree on the group's control page against gloo all_reduce(MIN) and the daemon's messages, same run.

    python bench/agree_page.py                      # N = 2, 4, 8, host backend
    python bench/agree_page.py --backend cuda --ranks 2,8 --rounds 100000
    python bench/agree_page.py --ranks 2 --rounds 100000 --spin-us 50

A daemon of its own (``--backend``) serves N spawned workers; each builds a
PeerBuffer of one group (the daemon hands every rank the set's control page,
peerd.pages) and a gloo group, then times the public ``tp_agree(True, key)``,
which runs on the page (the bench refuses a group left on the message path),
and ``tp_agree(True, key, rank, npes)`` of a group nobody holds a buffer of,
which goes through the daemon: the message path, the page's fallback, timed
in the same run so the page can be held against it (issue 16's target on an
oversubscribed machine: no worse than the message path). The measurements are bench/agree_latency.py's (time_paths): synchronized
rounds, p50 / p99 from a common instant until the slowest rank has the
answer, and back-to-back rounds, whose mean period gives rounds per second.
"""

from __future__ import annotations

import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
import agree_latency as AL  # noqa: E402

PATHS = ("page", "message", "gloo")


def page_worker(rank, npes, args, start: C.Start, port, results) -> None:
    try:
        from peerd_client import PeerBuffer, tp_agree
        from peerd_client.pagelink import link_for

        device = C.torch_device(args.backend)
        C.init_gloo(port, rank, npes)
        key = f"agree-page-{npes}"
        buf = PeerBuffer(4096, key, rank, npes, device)
        if not buf.abort_address:
            raise RuntimeError("the group was left on the daemon's message path: no control page to time")
        if args.spin_us is not None:
            link_for(key).voter.spin_s = args.spin_us * 1e-6
        by_message = f"agree-message-{npes}"  # no PeerBuffer of it: every round goes through the daemon
        timed = AL.time_paths({"page": lambda: tp_agree(True, key),
                               "message": lambda: tp_agree(True, by_message, rank, npes),
                               "gloo": AL.gloo_round()}, rank, args, start,
                              rounds={"message": min(args.rounds, args.message_rounds)})
        buf.close()
        results.put((rank, *timed, None))
    except BaseException:
        results.put((rank, {}, {}, {}, traceback.format_exc()))
        raise


def main() -> None:
    parser = AL.agreement_parser(__doc__.split("\n\n")[0], rounds=20000, warmup=200)
    parser.add_argument("--spin-us", type=float, default=None, help="microseconds a waiting rank spins before it "
                        "sleeps on the futex (default: peerd.controlpage.spin_budget)")
    parser.add_argument("--message-rounds", type=int, default=4000, help="back-to-back rounds of the message "
                        "path (about a millisecond each at 8 ranks), at most --rounds")
    args = parser.parse_args()

    info = {"bench": "agree_page", "machine": C.machine(), "backend": args.backend, "command": C.command_line(),
            "rounds": args.rounds, "spin_us": args.spin_us, "start_spin_s": C.spin_s(args.pin), "by_n": {}}
    with C.Daemon(args.backend, log_level="warning"):
        for npes in C.parse_ints(args.ranks):
            info["by_n"][str(npes)] = AL.measure(npes, args, page_worker, PATHS)
            C.save("agree_page", info, args.out, quiet=True)

    rows, rows2, rows3 = AL.sync_rows(info, "page"), [], []
    for n, r in info["by_n"].items():
        p, m, g = r["page"], r["message"], r["gloo"]
        rows2.append([n, f"{1 / p['round_period']:,.0f}", f"{1 / m['round_period']:,.0f}",
                      f"{1 / g['round_period']:,.0f}", C.ms(p["per_call"]["p50"]), C.ms(p["per_call"]["p99"]),
                      C.ms(g["per_call"]["p50"]), C.ms(g["per_call"]["p99"])])
        rows3.append([n, C.ms(p["sync"]["p50"]), C.ms(p["sync"]["p99"]), C.ms(m["sync"]["p50"]),
                      C.ms(m["sync"]["p99"]), C.ratio(p["sync"]["p50"], m["sync"]["p50"]),
                      C.ratio(p["sync"]["p99"], m["sync"]["p99"]), C.ratio(m["round_period"], p["round_period"])])
    print(f"\nagreement latency, synchronized rounds, ms ({args.sync_rounds} rounds per path; from the common "
          "start until the slowest rank has the answer; ratio = page / gloo)")
    print(C.table(["N", *AL.SYNC_COLUMNS], rows))
    print("\nthe page against the daemon's message path (its fallback), same rounds; ratio = page / message")
    print(C.table(["N", "page p50", "p99", "message p50", "p99", "ratio p50", "ratio p99",
                   "page rounds per message round"], rows3))
    print(f"\nback-to-back rounds ({args.rounds} rounds per path)")
    print(C.table(["N", "page rounds/s", "message rounds/s", "gloo rounds/s", "page call p50 ms", "p99",
                   "gloo call p50", "p99"], rows2))
    C.save("agree_page", info, args.out)


if __name__ == "__main__":
    main()
