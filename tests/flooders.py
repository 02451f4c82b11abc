"""Hostile local clients, one per process, for tests/integration/test_flood.py and bench/flood.py.

    python tests/flooders.py KIND --socket PATH [--as-user UID:GID[:GIDS]] [--count N]

Each prints one line, ``READY {json}``, once its flood is in place (or under
way), then keeps it up until it is killed:

  idle     --count raw connections, opened as fast as the daemon accepts them, held idle
  partial  --count connections, each announcing a 1 MiB frame and sending all of it but one byte
  ls       one connection that reads nothing (receive high-water mark 1) and sends --count `ls`
  hello    one connection sending `hello` in a tight loop, reading nothing
  sets     holds --count one-rank buffer sets of one group, key and names of the longest
           length allowed (protocol.MAX_KEY_CHARS), through one pipelined connection
  groups   holds --count one-rank buffer sets, each of a group of its own (their pages fill the
           uid's control page areas), through one pipelined connection; READY says how many got a page
  chunks   holds one-rank --nbytes (4 KiB) sets of one group, one after another, until the daemon
           refuses one or --count are held; READY says how many it holds and the refusal
  punch    the same with --nbytes sets, fetching each set's memfd over the fd channel and
           punching its pages out (the memory then reads as available again) before the next
  keep     --count one-rank sets of --nbytes, each of its own group: fetches each set's memfd and the
           uid's control page area over the fd channel as its member may, keeps both fds and releases the set;
           READY says how many sets it had and the bytes each kept fd still held once the daemon closed them
  frames   one message of --count empty frames (libzmq bounds a frame, not their number), then a
           `hello` on the same connection; prints DRAINED once the hello is answered (the daemon read
           past the message), and holds on
  withdraws  --count withdrawals with 1 KiB reasons through one connection, each failing a set of its own
           (two log lines a request, unbounded before peerd.logbudget); READY once all were answered
  claim    --count connections claiming the routing ids libzmq makes up for the daemon's next connections
           where nobody seeded rand() (0x00 6b8b4567 on), each saying hello; then a connection naming no id
           says hello (libzmq aborted the daemon when the id it made up was taken); READY says what each heard
  orphans  --count connections, each opened by a process that forks a child (which inherits it and
           never speaks on it, as a data loader) and exits; the children live as long as this flooder,
           and so do the openers as zombies with --unreaped (their pids stay taken)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import socket
import struct
import sys
import time

import msgpack
import zmq

#: ZMTP 3.0, NULL mechanism, as a DEALER: the greeting and the READY command
GREETING = b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\x00") + bytes(32)
_READY = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
READY = bytes([0x04, len(_READY)]) + _READY
PARTIAL_BYTES = (1 << 20) - 1  # announced; one byte fewer is sent
#: the counter behind the first routing id libzmq makes up where C's rand() was never seeded
UNSEEDED_FIRST_ID = 0x6B8B4567

#: the longest key the daemon takes (protocol.MAX_KEY_CHARS, 128); the group
#: and every name are this long
KEY_CHARS = 128
VERSION = 4  # protocol.VERSION: this script runs as other users, without peerd importable
SETS_GROUP = "g" * KEY_CHARS
WINDOW = 16  # requests the sets holder has in flight: a client that reads loses none


def request(request_id: int, op: str, body: dict) -> bytes:
    return msgpack.packb({"v": VERSION, "id": request_id, "op": op, "body": body}, use_bin_type=True)


def set_name(i: int) -> str:
    return f"{i:08d}".ljust(KEY_CHARS, "n")


def ready(**facts) -> None:
    print("READY " + json.dumps(facts), flush=True)


def hold() -> None:
    while True:
        time.sleep(3600)


def idle(args) -> None:
    held, failed = [], 0
    for _ in range(args.count):
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # blocking: waits while the backlog is full
        try:
            conn.connect(args.socket)
            held.append(conn)
        except OSError:
            failed += 1
            conn.close()
    ready(connected=len(held), failed=failed)
    hold()


def partial(args) -> None:
    header = bytes([0x02]) + struct.pack(">Q", PARTIAL_BYTES)  # a long frame, the last of its message
    body = bytes(PARTIAL_BYTES - 1)
    held, cut = [], 0
    for _ in range(args.count):
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(args.socket)
            conn.settimeout(2)
            conn.sendall(GREETING + READY + header + body)
            held.append(conn)
        except OSError:  # the daemon dropped it, at the header or before
            cut += 1
            conn.close()
    ready(sent=len(held), cut=cut)
    hold()


def _dealer(args, **options) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, b"p" + os.urandom(15))  # the daemon answers no other: peerd.routingids
    for option, value in options.items():
        sock.setsockopt(getattr(zmq, option), value)
    sock.connect(f"ipc://{args.socket}")
    return sock


def ls(args) -> None:
    sock = _dealer(args, RCVHWM=1, RCVBUF=4096)
    for i in range(args.count):
        sock.send(request(i + 1, "ls", {}))
    ready(sent=args.count)
    hold()


def hello(args) -> None:
    sock = _dealer(args)
    frame = request(1, "hello", {})
    sock.send(frame)
    ready()
    while True:
        sock.send(frame)


def frames(args) -> None:
    sock = _dealer(args, SNDHWM=0)
    sock.send_multipart([b""] * args.count + [request(1, "hello", {})])
    sock.send(request(2, "hello", {}))
    ready(frames=args.count)
    while msgpack.unpackb(sock.recv())["id"] != 2:
        pass
    print("DRAINED", flush=True)
    hold()


def orphans(args) -> None:
    alive_r, alive_w = os.pipe()  # the children read it until this flooder dies
    for _ in range(args.count):
        worker = os.fork()
        if worker == 0:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(args.socket)
            if os.fork() == 0:
                os.close(alive_w)
                os.read(alive_r, 1)
                os._exit(0)
            os._exit(0)
        if not args.unreaped:
            os.waitpid(worker, 0)
    ready(orphaned=args.count)
    hold()


def _slot(i: int) -> dict:
    return {"group": SETS_GROUP, "name": set_name(i), "rank": 0}


def _own_group(i: int) -> dict:
    return {"group": f"flood-{i}", "name": "n", "rank": 0}


def _hold_sets(args, slot) -> list[dict]:
    """Join and commit --count one-rank sets named by ``slot(i)``; the join replies."""
    sock = _dealer(args)
    ids, joined = iter(range(1, 2 * args.count + 1)), []
    for start in range(0, args.count, WINDOW):  # pipelined, a window at a time: a client that never
        window = range(start, min(start + WINDOW, args.count))  # reads would get its replies dropped
        for i in window:
            sock.send(request(next(ids), "join", {**slot(i), "npes": 1, "nbytes": 1, "device": "host"}))
        joined += _expect_ok(sock, len(window))
        for i in window:
            sock.send(request(next(ids), "commit", {**slot(i), "ok": True}))
        _expect_ok(sock, len(window))
    return joined


def sets(args) -> None:
    _hold_sets(args, _slot)
    ready(sets=args.count)
    hold()


def groups(args) -> None:
    joined = _hold_sets(args, _own_group)
    ready(sets=args.count, with_page=sum(body.get("page") is not None for body in joined))
    hold()


def chunks(args, punch: bool = False) -> None:
    sock, ids, held, refusal = _dealer(args), iter(range(1, 2 * args.count + 1)), 0, None
    for i in range(args.count):
        sock.send(request(next(ids), "join", {**_slot(i), "npes": 1, "nbytes": args.nbytes, "device": "host"}))
        reply = msgpack.unpackb(sock.recv())
        if not reply["ok"]:
            refusal = reply["error"]
            break
        sock.send(request(next(ids), "commit", {**_slot(i), "ok": True}))
        _expect_ok(sock, 1)
        held += 1
        if punch:
            _punch_out(args.socket + ".fd", _slot(i))
    ready(sets=held, refusal=refusal)
    hold()


def _fetch_fds(fd_channel: str, slot: dict) -> list[int]:
    """The fds the daemon hands a member of ``slot`` (peerd.fdchannel's protocol)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
        conn.connect(fd_channel)
        conn.send(msgpack.packb(slot, use_bin_type=True))
        _, fds, _, _ = socket.recv_fds(conn, 1 << 16, 8)
    return fds


def _punch_out(fd_channel: str, slot: dict) -> None:
    """Fetch the set's memfd as its member may and give its pages back."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    for fd in _fetch_fds(fd_channel, slot):
        assert libc.fallocate(fd, 0x02 | 0x01, 0, os.fstat(fd).st_size) == 0, os.strerror(ctypes.get_errno())
        os.close(fd)  # PUNCH_HOLE | KEEP_SIZE


def punch(args) -> None:
    chunks(args, punch=True)


def keep(args) -> None:
    sock, ids, refusal, sets = _dealer(args), iter(range(1, 3 * args.count + 1)), None, 0
    chunk_fds, area_fds = [], []
    for i in range(args.count):
        slot = _own_group(i)
        sock.send(request(next(ids), "join", {**slot, "npes": 1, "nbytes": args.nbytes, "device": "host"}))
        reply = msgpack.unpackb(sock.recv())
        if not reply["ok"]:
            refusal = reply["error"]
            break
        sock.send(request(next(ids), "commit", {**slot, "ok": True}))
        _expect_ok(sock, 1)
        chunk_fds += _fetch_fds(args.socket + ".fd", slot)
        area_fds.append(_fetch_fds(args.socket + ".fd", {**slot, "page": True})[0])  # then the alive pipe's
        sock.send(request(next(ids), "release", {**slot, "set": reply["body"]["set"]}))
        _expect_ok(sock, 1)
        sets += 1

    def held(fds: list[int]) -> list[int]:
        return [os.fstat(fd).st_blocks * 512 for fd in fds]

    deadline = time.monotonic() + 20
    while any(held(chunk_fds)) and time.monotonic() < deadline:  # the daemon closes them on threads
        time.sleep(0.1)
    ready(sets=sets, refusal=refusal, chunks=held(chunk_fds), areas=held(area_fds))
    hold()


def _expect_ok(sock: zmq.Socket, replies: int) -> list[dict]:
    bodies = []
    for _ in range(replies):
        reply = msgpack.unpackb(sock.recv())
        assert reply["ok"], reply
        bodies.append(reply["body"])
    return bodies


def withdraws(args) -> None:
    sock = _dealer(args)
    answered = 0
    for first in range(0, args.count, WINDOW):
        batch = range(first, min(first + WINDOW, args.count))
        for i in batch:
            sock.send(request(i + 1, "withdraw", {"group": "wd", "name": f"n{i % 1000}", "rank": 0, "npes": 2,
                                                  "reason": "A" * 1024}))
        answered += sum(1 for _ in batch if sock.poll(10_000) and sock.recv())
    ready(sent=args.count, answered=answered)
    hold()


def claim(args) -> None:
    sock_path = f"ipc://{args.socket}"
    claimed = []
    for i in range(args.count):
        sock = _dealer(args, ROUTING_ID=b"\x00" + (UNSEEDED_FIRST_ID + i).to_bytes(4, "big"), LINGER=0)
        sock.send(request(1, "hello", {}))
        claimed.append(sock)
    answered = [msgpack.unpackb(s.recv()) for s in claimed if s.poll(10_000)]
    plain = zmq.Context.instance().socket(zmq.DEALER)  # names itself nothing: libzmq makes its id up
    plain.setsockopt(zmq.LINGER, 0)
    plain.connect(sock_path)
    plain.send(request(1, "hello", {}))
    heard = msgpack.unpackb(plain.recv()) if plain.poll(10_000) else None
    ready(claimed=len(answered), claims_heard=sorted({(r.get("error") or {}).get("code", "ok") for r in answered}),
          plain_heard=heard)
    hold()


KINDS = {"idle": idle, "partial": partial, "ls": ls, "hello": hello, "sets": sets, "groups": groups,
         "chunks": chunks, "punch": punch, "orphans": orphans, "keep": keep, "frames": frames, "claim": claim,
         "withdraws": withdraws}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("--socket", required=True)
    parser.add_argument("--count", type=int, default=1)
    parser.add_argument("--nbytes", type=int, default=4096, help="each set's size (chunks, punch)")
    parser.add_argument("--unreaped", action="store_true", help="never reap the openers (orphans)")
    parser.add_argument("--as-user", default=None, help="uid:gid[:extra,gids]: drop to it first")
    args = parser.parse_args()
    if args.as_user:
        uid, gid, *extra = args.as_user.split(":")
        os.setgroups([int(g) for g in extra[0].split(",")] if extra and extra[0] else [])
        os.setgid(int(gid))
        os.setuid(int(uid))
    KINDS[args.kind](args)


if __name__ == "__main__":
    sys.exit(main())
