"""One rank agreeing on a control page it inherited as an fd, run as its own process.

    python tests/page_rank.py --fd FD --rank R --npes N --rounds K [--hold-at J] [--short-at J --short S]

Votes in rounds 1..K by a schedule every rank knows (``vote``), so each rank
checks every verdict against the AND of the schedule and the no-voters the
reason names. Prints one JSON line per round it is told to report
(``--report``), one ``{"entering": k}`` line before each of those, and a
summary line at the end. ``--jitter SEED`` pauses before some votes and
gives some rounds a deadline far shorter than the pauses, so rounds time
out at random: the summary then lists every verdict, which must be the
same on every rank. ``--hold-at J`` reads a line from stdin before
voting in round J (the test stops it there); ``--short-at J`` gives round J a
deadline of ``--short`` seconds instead of a long one.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time


def vote(k: int, rank: int) -> bool:
    return (k * 31 + rank * 17) % 13 != 0


def expected(k: int, npes: int) -> tuple[bool, list[int]]:
    no = [r for r in range(npes) if not vote(k, r)]
    return not no, no


def say(**fields) -> None:
    print(json.dumps(fields), flush=True)


def main() -> None:
    from peerd.pagearea import Area
    from peerd.pageagree import PageVoter

    parser = argparse.ArgumentParser()
    for name in ("--fd", "--rank", "--npes", "--rounds"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--instance", type=lambda v: int(v, 0), default=None)
    parser.add_argument("--hold-at", type=int, default=0)
    parser.add_argument("--short-at", type=int, default=0)
    parser.add_argument("--short", type=float, default=1.0)
    parser.add_argument("--report", type=lambda v: {int(x) for x in v.split(",") if x}, default=set())
    parser.add_argument("--jitter", type=int, default=None)
    args = parser.parse_args()
    page = Area.attach(args.fd).page(0, args.npes, instance=args.instance)
    voter = PageVoter(page, args.rank, label="group=test")
    failures, verdicts = [], []
    jitter = random.Random(args.jitter * 1000 + args.rank) if args.jitter is not None else None
    for k in range(1, args.rounds + 1):
        if k == args.hold_at:
            sys.stdin.readline()
        if k in args.report:
            say(entering=k)
        wait = args.short if k == args.short_at else 600.0
        if jitter is not None:
            if jitter.random() < 0.2:
                time.sleep(jitter.random() * 2e-3)
            wait = 5e-4 if jitter.random() < 0.2 else wait
        verdict = voter.agree(vote(k, args.rank), time.monotonic() + wait)
        verdicts.append(verdict.ok)
        if jitter is not None:
            if verdict.ok and not expected(k, args.npes)[0]:
                failures.append(f"round {k}: True although a rank voted no")
            continue
        if k in args.report:
            say(round=k, ok=verdict.ok, reason=verdict.reason)
            continue
        ok, no = expected(k, args.npes)
        if verdict.ok != ok or (not ok and f"rank(s) {no} voted no" not in verdict.reason):
            failures.append(f"round {k}: {verdict} but the votes were {ok} (no: {no})")
    say(done=True, rounds=voter.rounds, failures=failures[:10], verdicts="".join("TF"[not ok] for ok in verdicts))


if __name__ == "__main__":
    main()
