"""One member of a group with a control page, driven line by line by an integration test.

    python tests/page_member.py --group G --rank R --npes N [--name NAME] [--no-map | --no-voter] [--as-user U:G:GIDS]

Builds a PeerBuffer, prints one JSON line {"ready": ..., "page": bool, "where": ...}
("where": see ``where``), then answers each command read from stdin with one JSON line:

    agree [RANK NPES]   tp_agree(True) in the buffer's group (as RANK of NPES where given)
    refuse              tp_agree(False) in the buffer's group
    check               buf.check()
    where               where the buffer's page is: see ``where``
    garbage             overwrite this member's mapping of its page's WHOLE area with random bytes
    poke A OFF W=V...   forge, as a hostile process of the uid would: store each u64 V at byte W of the page at
                        byte OFF of area A (its id, as join replies name it) in this process's mapping, in order,
                        each sequentially consistent, then wake the page's sleepers; answers each word's value before
    peek A OFF W...     the u64s at bytes W of that page (numbers may be hex)
    reduce              all_reduce(buf, ones) on the host, polling the buffer's page: the sum
    fresh G R N [NAME]  a new PeerBuffer of group G as rank R of N in place of buf (which stays open);
                        tried twice where the first call finds the daemon restarted
    close               buf.close()

Every fd-channel request for a page area is counted (``page_fetches``).
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


def link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:  # the fd listdir itself used, closed by now
        return ""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--group", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--npes", type=int, required=True)
    parser.add_argument("--name", default="default")
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--build-timeout", type=float, default=30.0, help="the PeerBuffer's timeout: its "
                        "rendezvous and its commit vote")
    parser.add_argument("--no-map", action="store_true", help="this rank cannot map the page (mmap refused)")
    parser.add_argument("--no-voter", action="store_true", help="this rank's peerd was installed without a C "
                        "compiler: no compiled voter")
    parser.add_argument("--peers-fail-after", type=float, default=None, help="mapping its peers' buffers fails, "
                        "this many seconds after it began: the rank commits a no through a message")
    parser.add_argument("--as-user", default=None, help="uid:gid[:extra,gids]: drop to it before any call")
    args = parser.parse_args()
    if args.no_voter:
        sys.modules["peerd._pagevote"] = None  # what importing an extension that was never built raises
    import peerd_client.pagelink as pagelink

    if args.no_map:
        from peerd.controlpage import PageError

        def refused(fd):
            os.close(fd)
            raise PageError("mmap of the control page area failed: Cannot allocate memory")

        pagelink.Area.attach = refused
    fetches = []

    class CountedRequest(pagelink.FdRequest):  # every request for a page area this process sends
        def __init__(self, path, slot, *a, **kw):
            fetches.append(slot)
            super().__init__(path, slot, *a, **kw)

    pagelink.FdRequest = CountedRequest
    if args.peers_fail_after is not None:
        import time

        import peerd_client.buffer

        def fails(*_, **__):
            time.sleep(args.peers_fail_after)
            raise OSError("mmap of a peer's buffer failed: Cannot allocate memory")

        peerd_client.buffer.mappings.open = fails

    import torch

    from peerd_client import DaemonUnavailable, PeerBuffer, tp_agree
    from peerd_client.allreduce import all_reduce

    if args.as_user:
        from rank import become  # tests/rank.py, beside this script

        become(args.as_user)
    buf = PeerBuffer(1 << 16, args.group, args.rank, args.npes, name=args.name, timeout=args.build_timeout)
    group = args.group

    def where() -> dict | None:
        """The page's area (its memfd's inode, from /proc/self/maps) and offset in it; the page fetches
        so far; the control page fds this process holds."""
        page = buf._link.page if buf._link is not None else None
        held = [fd for fd in os.listdir("/proc/self/fd") if "controlpage" in link(f"/proc/self/fd/{fd}")]
        found = {"page_fetches": len(fetches), "fds": len(held)}
        for area in (h.area for h in pagelink._areas.values()):
            if page is not None and area.address <= page.address < area.address + area.size:
                start = f"{area.address:x}-"
                with open("/proc/self/maps") as maps:
                    inode = next(int(line.split()[4]) for line in maps if line.startswith(start))
                found.update(inode=inode, offset=page.address - area.address)
                found["area"] = next(a for (_, a), h in pagelink._areas.items() if h.area is area)
        return found

    print(json.dumps({"ready": True, "page": buf.abort_address != 0, "where": where()}), flush=True)

    def reduce() -> float:
        return float(all_reduce(buf, torch.ones(256), timeout=30)[0])

    earlier = []  # the buffers ``fresh`` replaced: open until they are closed, or the member exits

    def fresh(new_group: str, rank: str, npes: str, name: str = "default") -> bool:
        nonlocal buf, group
        earlier.append(buf)
        try:
            buf = PeerBuffer(1 << 16, new_group, int(rank), int(npes), name=name, timeout=30)
        except DaemonUnavailable:  # the first call after a daemon restart finds its connection gone
            buf = PeerBuffer(1 << 16, new_group, int(rank), int(npes), name=name, timeout=30)
        group = new_group
        return buf.abort_address != 0

    def garbage() -> int:
        areas = [h.area for h in pagelink._areas.values()]
        for area in areas:
            ctypes.memmove(area.address, os.urandom(area.size), area.size)
        return sum(area.size for area in areas)

    def page_in(area_id: str, offset: str):
        """The page at ``offset`` of area ``area_id`` as this process maps it, whoever's set is there now."""
        (area,) = [h.area for (_, a), h in pagelink._areas.items() if a == int(area_id)]
        return area.page_at(int(offset, 0), area.size - int(offset, 0))

    def poke(area_id: str, offset: str, *writes: str) -> list[int]:
        from peerd.atomics import atomics

        page, before = page_in(area_id, offset), []
        for write in writes:
            word, value = (int(v, 0) for v in write.split("="))
            before.append(page.word(word).value)
            atomics().store_seq_cst(page.word(word), value)
        page._wake_sleepers()  # as every writer of the page does
        return before

    def peek(area_id: str, offset: str, *words: str) -> list[int]:
        page = page_in(area_id, offset)
        return [page.word(int(word, 0)).value for word in words]

    for line in sys.stdin:
        command, *rest = line.split()
        if command == "agree":
            rank, npes = (int(rest[0]), int(rest[1])) if rest else (None, None)
            reply = answer(lambda: tp_agree(True, group, rank, npes, timeout=args.timeout))
        elif command == "refuse":
            reply = answer(lambda: tp_agree(False, group, timeout=args.timeout))
        elif command == "check":
            reply = answer(buf.check)
        elif command == "where":
            reply = answer(where)
        elif command == "garbage":
            reply = answer(garbage)
        elif command == "poke":
            reply = answer(lambda: poke(*rest))
        elif command == "peek":
            reply = answer(lambda: peek(*rest))
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
