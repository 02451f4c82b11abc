"""One rank of the arena tests (chunks shared, reused, zeroed), run as its own process.

    python tests/arena_rank.py SCENARIO --rank R --npes N --group G [--nbytes B] [--device cpu|cuda]

Prints one JSON line: what the rank saw, or the error it got.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def start(daemon, scenario: str, npes: int, *args: str, stdin=None) -> list[subprocess.Popen]:
    """Every rank of a group, as processes against ``daemon`` (tests.conftest.Daemon)."""
    from tests.forkserver import popen

    return [
        popen([sys.executable, __file__, scenario, "--rank", str(r), "--npes", str(npes), *args],
                         stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=daemon.env())
        for r in range(npes)
    ]


def _buffer(args, name: str):
    from peerd_client import PeerBuffer

    return PeerBuffer(args.nbytes, args.group, args.rank, args.npes, args.device, name=name)


def two_sets(args) -> dict:
    """A second set after a first one: does it reach the driver or the fd channel again?"""
    import peerd_client.buffer as buffer_module

    first = _buffer(args, "first")
    mapper_class = type(first._mapper)
    opens, fetches = [], []
    real_open, real_fetch = mapper_class.open, buffer_module.fetch_fds
    mapper_class.open = lambda self, *a, **k: opens.append(1) or real_open(self, *a, **k)
    buffer_module.fetch_fds = lambda *a, **k: fetches.append(1) or real_fetch(*a, **k)
    second = _buffer(args, "second")
    mine = (first.local, second.local)
    result = {"driver_opens": len(opens), "fd_fetches": len(fetches),
              "same_chunk": first._handles == second._handles,
              "apart": abs(mine[1] - mine[0]) >= args.nbytes}
    first.close()
    second.close()
    return result


def reuse(args) -> dict:
    """Dirty this rank's buffer, release the set, and take the set's ranges again: they must read zero."""
    from peerd_client import tp_agree

    buf = _buffer(args, "dirty")
    before = set(buf.pointers)
    buf.bytes.fill_(0xAB)
    buf.close()
    assert tp_agree(True, args.group), "barrier failed"  # every rank released: the set is freed
    again = _buffer(args, "dirty")
    result = {"same_range": set(again.pointers) == before, "zero": bool((again.bytes == 0).all())}
    again.close()
    return result


def keep(args) -> dict:
    """Fill this rank's buffer with rank+1, hold it until a line on stdin, then check every peer's is intact."""
    from peerd_client import tp_agree
    from peerd_client.views import byte_view

    buf = _buffer(args, "kept")
    buf.bytes.fill_(args.rank + 1)
    assert tp_agree(True, args.group), "barrier failed"
    print("READY", flush=True)
    sys.stdin.readline()
    intact = [bool((byte_view(pointer, args.nbytes, buf.device, owner=buf) == rank + 1).all())
              for rank, pointer in enumerate(buf.pointers)]
    buf.close()
    return {"intact": intact}


SCENARIOS = {"two_sets": two_sets, "reuse": reuse, "keep": keep}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=SCENARIOS)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--npes", type=int, required=True)
    parser.add_argument("--group", required=True)
    parser.add_argument("--nbytes", type=int, default=8 << 10)
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    print(json.dumps(outcome(SCENARIOS[args.scenario], args)), flush=True)


def outcome(scenario, args) -> dict:
    """What the scenario saw, or the error it got."""
    try:
        return {"ok": True, **scenario(args)}
    except Exception as err:
        return {"ok": False, "type": type(err).__name__, "message": str(err)}


if __name__ == "__main__":
    main()
