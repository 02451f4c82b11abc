"""Failure without hangs: real processes killed, a daemon killed, garbage on the wire."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess

import msgpack
import zmq

from peerd import protocol
from tests.conftest import finish, run_ranks, start_rank, wait_until


def joined(daemon, group, rank):
    return lambda: f"group={group} name=default rank={rank} " in daemon.logs()


def test_a_rank_killed_in_the_rendezvous_fails_every_waiting_rank_at_once(daemon):
    waiting = start_rank(daemon, "join", 0, 3, "--group", "kill-r", "--timeout", "120")
    victim = start_rank(daemon, "join", 1, 3, "--group", "kill-r", "--timeout", "120")
    wait_until(lambda: joined(daemon, "kill-r", 0)() and joined(daemon, "kill-r", 1)(), 90, "two ranks to join")
    victim.send_signal(signal.SIGKILL)
    result = finish(waiting, timeout=30)  # far inside the 120 s rendezvous timeout
    assert result["code"] == "RANK_DIED", result
    assert f"rank 1 (pid {victim.pid})" in result["message"] and "before every rank joined" in result["message"]
    assert daemon.segments() == []


def test_a_rank_that_dies_after_ready_counts_as_released_and_its_memory_stays(daemon):
    ranks = [start_rank(daemon, "join", r, 2, "--group", "late-death", "--hold", "60") for r in (0, 1)]
    wait_until(lambda: "group=late-death name=default live" in daemon.logs(), 90, "the set to go live")
    ranks[1].send_signal(signal.SIGKILL)
    wait_until(lambda: "rank=1 pid=%d died" % ranks[1].pid in daemon.logs(), 90, "the death to be seen")
    (entry,) = json.loads(daemon.cli("ls", "--json").stdout)
    assert entry["held"] == [0], "rank 0 still holds the set"
    assert len(daemon.segments()) == 2, "rank 1's memory must stay while rank 0 may still map it"
    ranks[0].send_signal(signal.SIGKILL)
    wait_until(lambda: daemon.segments() == [], 90, "the last holder's death to free the set")
    assert json.loads(daemon.cli("ls", "--json").stdout) == []


def test_a_call_waiting_on_a_killed_daemon_fails_fast_and_a_restarted_daemon_takes_over(daemon):
    waiting = start_rank(daemon, "join", 0, 2, "--group", "orphan", "--timeout", "120")
    wait_until(joined(daemon, "orphan", 0), 90, "rank 0 to join")
    old_pid = daemon.proc.pid
    assert len(daemon.segments()) == 1
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.proc.wait()
    result = finish(waiting, timeout=30)
    assert result["type"] == "DaemonUnavailable" and "went away" in result["message"], result
    assert os.path.exists(daemon.socket), "a SIGKILLed daemon leaves its socket behind"

    daemon.start()  # same socket: the stale socket and lock are taken over
    assert "removing stale socket" in daemon.logs()
    assert not [p for p in os.listdir("/dev/shm") if p.startswith(f"peerd-{old_pid}-")], "orphans swept"
    assert all(r["ok"] for r in run_ranks(daemon, "exchange", 2, "--group", "after"))


def test_the_next_call_after_a_daemon_restart_is_daemon_unavailable_then_it_reconnects(daemon):
    rank = start_rank(daemon, "restart", 0, 1, "--group", "restart", stdin=subprocess.PIPE)
    assert rank.stdout.readline().strip() == "READY"  # it holds a connection and waits
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.proc.wait()
    daemon.start()
    rank.stdin.write("go\n")
    rank.stdin.flush()
    result = finish(rank)
    assert result["first"] is True and result["third"] is True, result
    assert "went away" in result["second"]


def test_a_forked_child_gets_a_clear_error_and_leaves_the_parent_alone(daemon):
    results = run_ranks(daemon, "forked", 2, "--group", "forks")
    for r in results:
        assert r["ok"], r
        assert "is a forked child and shares none of its mappings" in r["child"]["verdict"]
        assert r["child"]["own"] is True and r["child_status"] == 0
        assert "is a forked child and holds none of its ranks" in r["child"]["agree"], r
        assert r["child"]["vote"] == "NOT_MEMBER", "only the process holding a rank may vote for it"
        assert r["agreed"] is True and r["pointers"] == 2, "the parents' rounds are unaffected"
    assert daemon.segments() == []


def _dealer(path: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(f"ipc://{path}")
    return sock


def test_garbage_on_the_socket_never_stops_the_daemon(daemon):
    rng = random.Random(1234)
    sock = _dealer(daemon.socket)
    # decodable requests that are wrong: each gets an error reply under its id
    bad = [
        {"v": 1, "id": 1, "op": "explode", "body": {}},
        {"v": 1, "id": 2, "op": "join", "body": {"group": "g"}},
        {"v": 1, "id": 3, "op": "join", "body": {"group": "g", "name": "n", "rank": -1, "npes": 2,
                                                "nbytes": 1, "device": "host"}},
        {"v": 1, "id": 4, "op": "join", "body": {"group": "g", "name": "n", "rank": 0, "npes": 2,
                                                "nbytes": 1 << 62, "device": "host"}},
        {"v": 7, "id": 5, "op": "ls", "body": {}},
    ]
    for message in bad:
        sock.send(msgpack.packb(message))
        reply = protocol.decode_reply(sock.recv())
        assert reply.id == message["id"] and not reply.ok and reply.error.code.value in (
            "UNKNOWN_OP", "BAD_REQUEST", "UNSUPPORTED_VERSION")
    # undecodable bytes: an error reply without an id
    for _ in range(50):
        sock.send(bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 300))))
    replies = 0
    while sock.poll(500):
        reply = protocol.decode_reply(sock.recv())
        assert not reply.ok
        replies += 1
    assert replies > 0
    sock.send_multipart([b"two", b"frames"])  # dropped: a request is exactly one frame
    sock.close()
    # a frame over ZMQ_MAXMSGSIZE: libzmq drops that connection
    big = _dealer(daemon.socket)
    big.send(b"\x00" * (protocol.MAX_FRAME_BYTES + 1024))
    assert not big.poll(1000)
    big.close()
    # raw bytes that are not even ZMTP
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.connect(daemon.socket)
    raw.sendall(bytes(rng.getrandbits(8) for _ in range(4096)))
    raw.close()

    assert all(r["ok"] for r in run_ranks(daemon, "exchange", 2, "--group", "still-works"))
    assert daemon.cli("status").returncode == 0
    assert "sent a bad request" in daemon.logs() and "dropped a message of 3 frames" in daemon.logs()


def test_a_call_waiting_on_a_frozen_daemon_fails_within_a_heartbeat(daemon):
    waiting = start_rank(daemon, "join", 0, 2, "--group", "frozen", "--timeout", "120")
    wait_until(joined(daemon, "frozen", 0), 90, "rank 0 to join")
    daemon.proc.send_signal(signal.SIGSTOP)  # alive but silent: only heartbeats can tell
    try:
        result = finish(waiting, timeout=30)  # far inside the 120 s rendezvous timeout
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    assert result["type"] == "DaemonUnavailable" and "went away" in result["message"], result
