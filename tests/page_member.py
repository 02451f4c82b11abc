"""One member of a group with a control page, driven line by line by an integration test.

    python tests/page_member.py --group G --rank R --npes N [--name NAME] [--no-map | --no-voter]

Builds a PeerBuffer, prints one JSON line {"ready": ..., "page": bool}, then
answers each command read from stdin with one JSON line:

    agree [RANK NPES]   tp_agree(True) (as RANK of NPES where given)
    check               buf.check()
    garbage             overwrite this member's mapping of the page with random bytes
    reduce              all_reduce(buf, ones) on the host, polling the buffer's page: the sum
    fresh G R N         a new PeerBuffer of group G as rank R of N in place of buf
    close               buf.close()
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys


def answer(step) -> dict:
    try:
        return {"ok": True, "value": step()}
    except Exception as err:
        return {"ok": False, "type": type(err).__name__, "code": getattr(err, "code", None), "message": str(err)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--group", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--npes", type=int, required=True)
    parser.add_argument("--name", default="default")
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--no-map", action="store_true", help="this rank cannot map the page (mmap refused)")
    parser.add_argument("--no-voter", action="store_true", help="this rank's peerd was installed without a C "
                        "compiler: no compiled voter")
    args = parser.parse_args()
    if args.no_voter:
        sys.modules["peerd._pagevote"] = None  # what importing an extension that was never built raises
    if args.no_map:
        import peerd_client.pagelink
        from peerd.controlpage import PageError

        def refused(fd, **_):
            os.close(fd)
            raise PageError("mmap of the control page failed: Cannot allocate memory")

        peerd_client.pagelink.ControlPage.attach = refused

    import torch

    from peerd_client import PeerBuffer, tp_agree
    from peerd_client.allreduce import all_reduce

    buf = PeerBuffer(1 << 16, args.group, args.rank, args.npes, name=args.name, timeout=30)
    print(json.dumps({"ready": True, "page": buf.abort_address != 0}), flush=True)

    def reduce() -> float:
        return float(all_reduce(buf, torch.ones(256), timeout=30)[0])

    def fresh(group: str, rank: str, npes: str) -> bool:
        nonlocal buf
        buf = PeerBuffer(1 << 16, group, int(rank), int(npes), timeout=30)
        return buf.abort_address != 0

    def garbage() -> int:
        page = buf.abort_source
        ctypes.memmove(page.address, os.urandom(page.size), page.size)
        return page.size

    for line in sys.stdin:
        command, *rest = line.split()
        if command == "agree":
            rank, npes = (int(rest[0]), int(rest[1])) if rest else (None, None)
            reply = answer(lambda: tp_agree(True, args.group, rank, npes, timeout=args.timeout))
        elif command == "check":
            reply = answer(buf.check)
        elif command == "garbage":
            reply = answer(garbage)
        elif command == "reduce":
            reply = answer(reduce)
        elif command == "fresh":
            reply = answer(lambda: fresh(*rest))
        elif command == "close":
            reply = answer(buf.close)
        else:
            reply = {"ok": False, "message": f"unknown command {command!r}"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
