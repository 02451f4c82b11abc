"""What a worker sees of the client library beyond the happy path."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from tests.conftest import Daemon, finish, run_ranks, start_rank, wait_until


def test_garbage_collection_releases_a_dropped_buffer(daemon):
    results = run_ranks(daemon, "dropped", 2, "--group", "gc")
    assert [r["left"] for r in results] == [[], []], results
    assert daemon.settled_segments() == []


def test_a_bytes_view_keeps_its_buffer_alive_and_the_buffer_goes_with_it(daemon):
    """A view of a collected buffer read memory unmapped under it (128 MiB: a chunk of its own, unmapped at
    release), a SIGSEGV; a torch tensor keeps its storage, so the view keeps its buffer."""
    results = run_ranks(daemon, "outlived", 2, "--group", "outlived", "--nbytes", str(128 << 20))
    assert [(r.get("filled"), r.get("held"), r.get("left")) for r in results] == [(True, 1, [])] * 2, results


def test_a_buffer_closed_while_another_thread_votes_on_its_group_never_breaks_the_vote(daemon):
    (result,) = run_ranks(daemon, "close_race", 1, "--group", "close-race", timeout=120)
    assert result.get("unexpected") == [], result


def test_no_daemon_is_daemon_unavailable_saying_how_to_start_one(socket_dir):
    ghost = Daemon(os.path.join(socket_dir, "none.sock"), None)
    (result,) = run_ranks(ghost, "join", 2, ranks=[0])
    assert result["type"] == "DaemonUnavailable"
    assert "no peerd daemon socket at" in result["message"] and "peerd serve" in result["message"]


def test_a_stale_socket_with_no_daemon_is_daemon_unavailable_saying_nobody_listens(socket_dir):
    """A crashed daemon's socket file: ZeroMQ retries it quietly (a supervisor may be restarting the daemon,
    so the hello is waited for), and at the connect timeout the error says why: nobody listens there."""
    import socket as sk

    path = os.path.join(socket_dir, "stale.sock")
    s = sk.socket(sk.AF_UNIX, sk.SOCK_STREAM)
    s.bind(path)  # a socket file nobody listens on, as a crashed daemon leaves it
    s.close()
    ghost = Daemon(path, None, extra_env={"PEERD_CONNECT_TIMEOUT": "1"})
    (result,) = run_ranks(ghost, "agree", 2, ranks=[0], timeout=60)
    assert result["type"] == "DaemonUnavailable", result
    assert f"peerd daemon at {path} did not answer hello within 1s: nobody listens there" in result["message"]
    assert "peerd serve" in result["message"], result


def test_a_daemon_started_on_a_stale_socket_within_the_connect_timeout_is_reached(socket_dir):
    """A supervisor restarting a crashed daemon leaves its socket with nobody listening for a while: a
    worker that connects meanwhile reaches the new daemon, as long as it comes within the connect timeout."""
    import socket as sk

    path = os.path.join(socket_dir, "peerd.sock")
    s = sk.socket(sk.AF_UNIX, sk.SOCK_STREAM)
    s.bind(path)
    s.close()
    d = Daemon(path, Path(socket_dir) / "daemon.log", extra_env={"PEERD_CONNECT_TIMEOUT": "20"})
    rank = start_rank(d, "agree", 0, 1, "--votes", "1")
    time.sleep(1.5)  # the worker is waiting for its hello
    d.start()
    try:
        result = finish(rank, timeout=60)
        assert result["ok"] and result["results"] == [True], result
    finally:
        assert d.stop() == 0, d.logs()


def test_a_daemon_that_listens_but_never_answers_is_waited_for_the_whole_connect_timeout(socket_dir):
    """A daemon that is only slow, its loop stuck (a hung driver call), still accepts connections: the hello
    is waited for until the timeout, and the error says it listens but does not answer."""
    flag = Path(socket_dir) / "stall"
    d = Daemon(os.path.join(socket_dir, "peerd.sock"), Path(socket_dir) / "daemon.log",
               launcher=(sys.executable, str(Path(__file__).parent.parent / "stalling_daemon.py")),
               daemon_env={"PEERD_TEST_STALL_FILE": str(flag)}, extra_env={"PEERD_CONNECT_TIMEOUT": "2"}).start()
    try:
        flag.touch()
        (result,) = run_ranks(d, "agree", 2, ranks=[0], timeout=60)
        assert result["type"] == "DaemonUnavailable", result
        assert f"peerd daemon at {d.socket} did not answer hello within 2s: it accepts connections but its loop " \
            "does not answer" in result["message"], result
    finally:
        flag.unlink(missing_ok=True)
        assert d.stop() == 0, d.logs()


def test_without_torch_peerbuffer_says_so_and_tp_agree_still_works(daemon):
    results = run_ranks(daemon, "no_torch", 2, "--group", "bare")
    for r in results:
        assert r["ok"] and r["agreed"] is True, r
        assert "peerd_client needs torch" in r["import_error"] and "pip install torch" in r["import_error"]


def test_a_chunk_is_mapped_once_per_process_however_often_it_is_opened(daemon):
    results = run_ranks(daemon, "cache", 3, "--group", "cached")
    for r in results:
        assert r["ok"], r
        assert r["same"] and r["driver_opens"] == 0, "a cached chunk must not reach the driver again"
        assert r["mapped_while_open"] == 1, "the three ranks' buffers share one chunk and one mapping"
        assert r["mapped_after_close"] == 1, "an unused chunk stays mapped for the next buffer in it"


def test_a_deadline_no_wait_can_honour_is_refused_alike_on_the_page_and_through_the_daemon(daemon):
    (r,) = run_ranks(daemon, "bad_timeouts", 1, "--group", "deadlines")
    assert r["page"] == r["messages"] == ["BAD_REQUEST"] * 4 + [True], r
    assert r["buffer"] == ["BAD_REQUEST"] * 4, "refused before it is used: inf overflowed a lock's wait"


def test_a_call_waiting_for_another_threads_turn_on_the_connection_ends_at_its_own_deadline(daemon):
    """Calls of one process's threads take turns on its connection; one that waited behind another's
    9 s vote used to start its own 1 s only then (10 s in all); it raises TIMEOUT at its deadline now,
    having sent nothing, while the other thread still waits."""
    (r,) = run_ranks(daemon, "vote_behind_busy_thread", 1, "--group", "behind", timeout=120)
    assert r["raised"] == "TIMEOUT" and "another thread of this process" in r["message"], r
    assert r["other_thread_still_waiting"] and r["lonely"] == {"verdict": False}, r


def test_a_call_that_got_its_turn_late_sends_the_daemon_only_the_wait_left(daemon):
    """A vote that waited 7.5 s for another thread's turn sent the daemon its whole 8 s wait but waited
    itself only what was left of 13 s: it gave up first, raising DaemonUnavailable on a daemon that was
    only keeping its round open, while a peer voting later could still hear True. It hears its round's
    False at its own deadline now."""
    (r,) = run_ranks(daemon, "vote_after_busy_thread", 1, "--group", "late-turn", timeout=120)
    assert r["verdict"] is False, r
    assert 7.0 < r["took"] < 10.0, r


def test_ctrl_c_at_any_instant_of_a_call_never_leaves_the_connection_held(daemon):
    """A Ctrl-C landing just after the connection's lock was taken, or at the start of the code that
    lets it go, left it held for good: every later call waited out its deadline, and the buffer's release
    at close was never sent. Thousands of interrupts at random instants; the old code fell within
    about a hundred."""
    result = run_ranks(daemon, "ctrl_c_storm", 1, "--hold", "8", "--group", "storm")[0]
    assert result["ok"] and result["interrupts"] > 1000 and result["free"], result
    wait_until(lambda: "no buffer sets" in daemon.cli("ls").stdout, 10, "the closed buffer's release")


def test_numpy_integers_size_and_place_a_buffer(daemon):
    """Engines compute sizes with numpy (np.prod(shape) * itemsize); an np.int64 size was refused as not an int."""
    results = run_ranks(daemon, "numpy_sizes", 2, "--group", "numpy-sized", "--nbytes", "4096")
    assert all(r["ok"] and r["agreed"] and r["nbytes"] == 4096 and r["types"] == ["int"] * 3 for r in results), results


def test_a_client_that_keeps_its_whole_window_in_flight_and_reads_loses_no_reply(daemon):
    """Note [Reply window]: libzmq hears late that a client read its replies, so a daemon that took its
    count at face value dropped replies of a client with 16 requests in flight (the throughput benchmark
    stalled). A raw DEALER keeps CLIENT_WINDOW requests in flight for 20,000 replies: every one comes."""
    import zmq

    from peerd.paths import endpoint
    from peerd.protocol import decode_reply, encode_request
    from peerd.routingids import new_routing_id
    from peerd.server import CLIENT_WINDOW

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, new_routing_id())
    sock.connect(endpoint(daemon.socket))
    ids, pending, answered = iter(range(1, 1 << 30)), set(), 0

    def ask() -> None:
        pending.add(request_id := next(ids))
        sock.send(encode_request(request_id, "ls", {}))

    try:
        for _ in range(CLIENT_WINDOW):
            ask()
        while pending and sock.poll(10_000):
            pending.discard(decode_reply(sock.recv()).id)
            answered += 1
            if answered + len(pending) <= 20_000:
                ask()
    finally:
        sock.close()
    assert not pending, f"{len(pending)} of {answered + len(pending)} replies never came:\n{daemon.logs()[-2000:]}"
    assert "dropped" not in daemon.logs(), daemon.logs()[-2000:]
