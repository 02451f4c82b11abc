"""Failure without hangs: real processes killed, a daemon killed, garbage on the wire."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from peerd import protocol
from peerd.routingids import new_routing_id
from peerd.tally import LOG_EVERY_S
from peerd_client.stoppedpeers import POLL_S
from peerd_client.teardown import RELEASE_WAIT_S
from tests.conftest import HERE, Daemon, child_of, finish, memfd_holders, run_ranks, start_rank, wait_until
from tests.integration.test_access import call


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
    assert daemon.settled_segments() == []


def test_a_rank_that_dies_after_ready_counts_as_released_and_its_memory_stays(daemon):
    ranks = [start_rank(daemon, "join", r, 2, "--group", "late-death", "--hold", "60") for r in (0, 1)]
    wait_until(lambda: "group=late-death name=default live" in daemon.logs(), 90, "the set to go live")
    ranks[1].send_signal(signal.SIGKILL)
    wait_until(lambda: "rank=1 pid=%d died" % ranks[1].pid in daemon.logs(), 90, "the death to be seen")
    (entry,) = json.loads(daemon.cli("ls", "--json").stdout)
    assert entry["held"] == [0], "rank 0 still holds the set"
    (device,) = json.loads(daemon.cli("status", "--json").stdout)["devices"]
    assert [a["handed_out_bytes"] for a in device["arenas"]] == [2 << 16], \
        "rank 1's memory must stay while rank 0 may still map it"
    ranks[0].send_signal(signal.SIGKILL)
    wait_until(lambda: daemon.segments() == [], 90, "the last holder's death to free the set")
    assert json.loads(daemon.cli("ls", "--json").stdout) == []


def test_a_call_waiting_on_a_killed_daemon_fails_fast_and_a_restarted_daemon_takes_over(daemon):
    waiting = start_rank(daemon, "join", 0, 2, "--group", "orphan", "--timeout", "120")
    wait_until(joined(daemon, "orphan", 0), 90, "rank 0 to join")
    held = set(daemon.segments())
    assert len(held) == 1
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.proc.wait()
    result = finish(waiting, timeout=30)
    assert result["type"] == "DaemonUnavailable" and "went away" in result["message"], result
    assert os.path.exists(daemon.socket), "a SIGKILLed daemon leaves its socket behind"

    daemon.start()  # same socket: the stale socket and lock are taken over
    assert "removing stale socket" in daemon.logs()
    assert not memfd_holders(held), "the dead daemon's memory died with it"
    assert all(r["ok"] for r in run_ranks(daemon, "exchange", 2, "--group", "after"))


def test_a_worker_that_never_closed_its_buffer_exits_after_its_daemon_died(daemon):
    """Engines keep their buffers for life: collected at exit, a buffer whose release could not go out started
    the background retry thread during finalization, which hangs for ever in Thread.start on Python 3.10
    and 3.11 (3.12 raises instead): the worker never exited. The buffer is held in a reference cycle (an
    engine object), so the interpreter's last collection at exit is what collects it."""
    script = ("import gc, sys, torch\nfrom peerd_client import PeerBuffer\nclass Engine: pass\n"
              "engine = Engine()\nengine.me = engine\n"
              "engine.buf = PeerBuffer(4096, 'kept', 0, 1, torch.device('cpu'))\n"
              "del engine\ngc.disable()\nprint('HELD', flush=True)\nsys.stdin.readline()\n")
    worker = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=daemon.env())
    assert worker.stdout.readline().strip() == "HELD", worker.stderr.read()
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.proc.wait()
    worker.stdin.write("exit\n")
    worker.stdin.flush()
    try:
        assert worker.wait(timeout=30) == 0, worker.stderr.read()
    finally:
        worker.kill()
    daemon.start()  # for the fixture's clean stop


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


def test_the_first_peerbuffer_after_a_daemon_restart_works(daemon):
    """A new PeerBuffer reads the dropped connection off its monitor and reconnects: it used to get the
    dead connection's DaemonUnavailable, after tp_agree had already said the daemon went away."""
    rank = start_rank(daemon, "rebuilt_after_restart", 0, 1, "--group", "rebuilt", stdin=subprocess.PIPE)
    _line(rank, "READY")
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.proc.wait()
    daemon.start()
    _say(rank)
    result = finish(rank)
    assert result["ok"] and result["agreed_on_new_set"] is True, result
    assert result["vote_on_old_set"].startswith("DaemonUnavailable") and "went away" in result["vote_on_old_set"]
    # the dead daemon's chunk stays mapped while its buffer is open, and goes at its close: kept, it pinned
    # the dead daemon's memory for the worker's life, one more chunk at every restart
    assert result["dead_chunks_while_old_open"] == 1 and result["dead_chunks_after"] == 0, result


def test_a_fixed_relaunch_is_not_told_the_failed_launchs_verdict(daemon):
    """A launch with a typo (rank 1 came first, with npes=3), fixed and launched again: the kept verdict
    was for the 3-rank set's missing rank 2, and the relaunch got the old MISMATCH, naming dead pids."""
    typo = start_rank(daemon, "join", 1, 3, "--group", "relaunched")
    wait_until(lambda: "group=relaunched name=default rank=1" in daemon.logs(), 60, "rank 1's join")
    first_launch = [finish(start_rank(daemon, "join", 0, 2, "--group", "relaunched")), finish(typo)]
    assert [r["code"] for r in first_launch] == ["MISMATCH", "MISMATCH"], first_launch
    relaunch = run_ranks(daemon, "join", 2, "--group", "relaunched")
    assert all(r["ok"] for r in relaunch), relaunch
    assert "a relaunch, so the set's verdict" in daemon.logs()


def test_a_forked_child_gets_a_clear_error_and_leaves_the_parent_alone(daemon):
    results = run_ranks(daemon, "forked", 2, "--group", "forks")
    for r in results:
        assert r["ok"], r
        assert "is a forked child and shares none of its mappings" in r["child"]["verdict"]
        assert r["child"]["mapped"] == [], "a forked child would keep the memory its parent released"
        assert r["child"]["own"] is True and r["child_status"] == 0
        assert "is a forked child and holds none of its ranks" in r["child"]["agree"], r
        assert r["child"]["vote"] == "NOT_MEMBER", "only the process holding a rank may vote for it"
        assert r["agreed"] is True and r["pointers"] == 2, "the parents' rounds are unaffected"
    assert daemon.settled_segments() == []


def _dealer(path: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.setsockopt(zmq.ROUTING_ID, new_routing_id())
    sock.connect(f"ipc://{path}")
    return sock


def test_garbage_on_the_socket_never_stops_the_daemon(daemon):
    rng = random.Random(1234)
    sock = _dealer(daemon.socket)
    # decodable requests that are wrong: each gets an error reply under its id
    bad = [
        {"v": protocol.VERSION, "id": 1, "op": "explode", "body": {}},
        {"v": protocol.VERSION, "id": 2, "op": "join", "body": {"group": "g"}},
        {"v": protocol.VERSION, "id": 3, "op": "join", "body": {"group": "g", "name": "n", "rank": -1, "npes": 2,
                                                "nbytes": 1, "device": "host"}},
        {"v": protocol.VERSION, "id": 4, "op": "join", "body": {"group": "g", "name": "n", "rank": 0, "npes": 2,
                                                "nbytes": 1 << 63, "device": "host"}},
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
    # counted as they come, logged as a summary per cause at most every LOG_EVERY_S: a flood is a few lines
    wait_until(lambda: "not identity + one payload (dropped)" in daemon.logs(), LOG_EVERY_S + 5,
               "the summary of the malformed messages")
    summaries = [line for line in daemon.logs().splitlines() if "malformed message(s)" in line]
    assert any("uid 0: BAD_REQUEST" in line for line in summaries), summaries
    assert len(summaries) <= 6, f"{len(summaries)} lines for about 60 malformed messages"


def test_a_call_waiting_on_a_frozen_daemon_fails_within_a_heartbeat(daemon):
    waiting = start_rank(daemon, "join", 0, 2, "--group", "frozen", "--timeout", "120")
    wait_until(joined(daemon, "frozen", 0), 90, "rank 0 to join")
    daemon.proc.send_signal(signal.SIGSTOP)  # alive but silent: only heartbeats can tell
    try:
        result = finish(waiting, timeout=30)  # far inside the 120 s rendezvous timeout
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    assert result["type"] == "DaemonUnavailable" and "went away" in result["message"], result


def _line(proc, expected: str) -> str:
    line = proc.stdout.readline()
    assert line.startswith(expected), f"expected {expected}, got {line!r}: {proc.stderr.read() if proc.poll() else ''}"
    return line


def _say(proc, line: str = "go") -> None:
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def _held(daemon) -> list:
    return [(g["group"], g["held"]) for g in json.loads(daemon.cli("ls", "--json").stdout) if g["held"]]


def test_a_rank_resumed_after_its_deadline_sees_the_verdict_and_holds_nothing(daemon):
    """SIGSTOP a rank inside the rendezvous, SIGCONT it after its client deadline: its set ends up released."""
    for trial in range(3):
        group = f"stopped{trial}"
        ranks = [start_rank(daemon, "patient", r, 2, "--group", group, "--timeout", "2", stdin=subprocess.PIPE)
                 for r in (0, 1)]
        for p in ranks:
            _line(p, "READY")
        _say(ranks[1])
        wait_until(joined(daemon, group, 1), 60, "rank 1 to join")
        ranks[1].send_signal(signal.SIGSTOP)  # inside the rendezvous: its handles arrive while it is stopped
        _say(ranks[0])
        waited = json.loads(_line(ranks[0], "OUTCOME")[8:])
        assert waited["code"] in ("GROUP_FAILED", "TIMEOUT"), ("the commit vote times out without rank 1", waited)
        wait_until(lambda: f"group={group} name=default failed" in daemon.logs(), 60, "the set to fail")
        time.sleep(6)  # past rank 1's client deadline: 2 s timeout + 5 s grace since it joined, 2 s or more ago
        ranks[1].send_signal(signal.SIGCONT)
        outcome = json.loads(_line(ranks[1], "OUTCOME")[8:])
        # the verdict: rank 0's commit vote on the set's control page timed out waiting for rank 1 or, where
        # rank 0's join came after rank 1's 2 s rendezvous deadline on a loaded machine, the rendezvous did
        assert f"group={group} name=default" in outcome["message"], outcome
        said = outcome["message"]
        page_vote = "(waited at most 2s)" in said and "timed out waiting for rank(s) [1]" in said
        assert page_vote or "timed out after 2" in said or "did not answer" in said, outcome
        wait_until(lambda: _held(daemon) == [], 30, "the failed set to be released")
        assert all(p.poll() is None for p in ranks), "released while the ranks still live"
        for p in ranks:
            _say(p)
            finish(p)
    assert daemon.settled_segments() == []


def test_a_call_past_its_deadline_still_reads_the_answer_that_came(daemon):
    """As for a process stopped through its whole deadline: the answer is there, so it is the result."""
    (result,) = run_ranks(daemon, "call", 1, "--op", "status", "--timeout", "0.000001")
    assert result["ok"] and result["reply"]["pid"] == daemon.proc.pid, result


def test_a_rank_that_gives_up_on_its_join_releases_its_slot_once_the_daemon_answers(daemon):
    rank = start_rank(daemon, "patient", 1, 2, "--group", "gave-up", "--timeout", "120", stdin=subprocess.PIPE)
    _line(rank, "READY")
    _say(rank)
    wait_until(joined(daemon, "gave-up", 1), 60, "rank 1 to join")
    daemon.proc.send_signal(signal.SIGSTOP)
    try:
        outcome = json.loads(_line(rank, "OUTCOME")[8:])  # the heartbeat: it gives up, far inside its 120 s
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    assert outcome["type"] == "DaemonUnavailable", outcome
    wait_until(lambda: _held(daemon) == [], 30, "its slot to be released")
    assert rank.poll() is None, "released by the rank that gave up, not by its exit"
    _say(rank)
    finish(rank)


def _stopped_briefly_then_long(ranks: list, stop_pid: int, also_continue: tuple[int, ...] = ()) -> list[dict]:
    """Rank 1 (``stop_pid`` here) is stopped for 1 s, then for 8 s, while rank 0 votes each time: both ranks'
    results, checked against a grace of 3 s. ``also_continue``: processes a stop of rank 1 stops too."""
    for proc in ranks:
        _line(proc, "READY")
    waiter, stopped = ranks
    for pause in (1.0, 8.0):
        _line(stopped, "NEXT")
        stopped_at = time.monotonic()  # CLOCK_MONOTONIC: every process of the machine reads the same
        os.kill(stop_pid, signal.SIGSTOP)
        _say(waiter)
        time.sleep(pause)
        for pid in (stop_pid, *also_continue):
            os.kill(pid, signal.SIGCONT)
        _say(stopped)
        time.sleep(1.5 * POLL_S)  # a poll sees it running between the two stops, or they count as one
    results = [finish(proc) for proc in ranks]
    mine, its = results
    assert mine["page"] and its["page"], "the group must be on its control page, or nothing is tested"
    assert mine["short"]["agreed"] and mine["short"]["aborted"] is None, mine
    assert its["short"]["agreed"], its
    long = mine["long"]  # the grace counts from the first poll that saw rank 1 stopped: at or after the stop
    assert not long["agreed"] and 3 <= long["ended_at"] - stopped_at < 7, (long, stopped_at)
    assert f"rank 1 (pid {its['pid']})" in long["aborted"] and "has been stopped" in long["aborted"], long
    # resumed, the stopped rank hears why, though its peer released its buffer meanwhile (MEMBER_LEFT comes after)
    assert not its["long"]["agreed"] and "has been stopped" in its["long"]["aborted"], its
    return results


def test_a_rank_stopped_past_the_grace_aborts_its_group_and_one_stopped_briefly_does_not(socket_dir):
    """A stopped rank is alive, so nothing the daemon sees ends its peers' waits (a kernel polling the
    abort word waits for ever). Its peers watch it: stopped for less than PEERD_STOPPED_ABORT_S, the
    group goes on; stopped longer, a peer aborts the group's page naming it, and every wait ends."""
    d = Daemon(os.path.join(socket_dir, "peerd.sock"), Path(socket_dir) / "daemon.log",
               extra_env={"PEERD_STOPPED_ABORT_S": "3"}).start()
    ranks = []
    try:
        ranks += [start_rank(d, "beside_stopped", r, 2, "--group", "stopped", "--timeout", "30",
                            stdin=subprocess.PIPE) for r in range(2)]
        results = _stopped_briefly_then_long(ranks, ranks[1].pid)
    finally:
        for proc in ranks:
            proc.kill()
        assert d.stop() == 0, d.logs()
    assert results[1]["pid"] == ranks[1].pid


def test_a_rank_stopped_before_its_commit_vote_fails_the_setup_after_the_grace_not_the_timeout(socket_dir):
    """The peers began watching for a stopped rank only once the set was live: one stopped between its
    join's answer and its commit vote held them in the vote for their whole agreement timeout (60 s by
    default), with a reason that did not say it was stopped, and the daemon's verdict blamed the waiter."""
    d = Daemon(os.path.join(socket_dir, "peerd.sock"), Path(socket_dir) / "daemon.log",
               extra_env={"PEERD_STOPPED_ABORT_S": "2"}).start()
    ranks = [start_rank(d, "stops_before_its_vote", r, 2, "--group", "setup-stop", "--timeout", "120")
             for r in range(2)]
    try:
        waiting = finish(ranks[0], timeout=100)
        assert waiting["code"] == "GROUP_FAILED" and "has been stopped" in waiting["raised"], waiting
        assert f"pid {ranks[1].pid}" in waiting["raised"] and waiting["after_s"] < 60, waiting
        # the daemon hears the stop from the waiting rank's no: what a retry is told while rank 1 lives
        wait_until(lambda: "has been stopped" in d.cli("ls").stdout, 10, "the set's verdict to name the stop")
    finally:
        for proc in ranks:
            proc.kill()
            proc.wait()
        assert d.stop() == 0, d.logs()


@pytest.mark.skipif(not (shutil.which("unshare") and shutil.which("nsenter")), reason="needs util-linux's "
                    "unshare and nsenter")
def test_ranks_in_a_pid_namespace_of_their_own_watch_each_other_by_the_pids_they_claimed(socket_dir):
    """Worker pods keep their own pid namespace while the daemon runs in the host's (docs/kubernetes.md):
    the pids the daemon saw name other processes there, so the members watch each other by the pids
    each claimed in its join, and a rank stopped past the grace still aborts its group."""
    d = Daemon(os.path.join(socket_dir, "peerd.sock"), Path(socket_dir) / "daemon.log",
               extra_env={"PEERD_STOPPED_ABORT_S": "3"}).start()
    pod = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", "sleep", "600"])
    ranks = []
    try:
        init = child_of(pod.pid)  # the namespace's pid 1; the ranks join its pid and mount (its /proc) namespaces
        ranks += [subprocess.Popen(
            ["nsenter", "--target", str(init), "--pid", "--mount", "--", sys.executable, str(HERE / "rank.py"),
             "beside_stopped", "--rank", str(r), "--npes", "2", "--group", "pod", "--timeout", "30"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=d.env())
            for r in range(2)]
        stop_pid = child_of(ranks[1].pid)  # rank 1 as the host (and the daemon) sees it
        # nsenter, waiting for rank 1, stops itself when rank 1 stops, as a shell's job would
        results = _stopped_briefly_then_long(ranks, stop_pid, also_continue=(ranks[1].pid,))
    finally:
        for proc in ranks:
            proc.kill()
        pod.kill()
        pod.wait()
        assert d.stop() == 0, d.logs()
    assert results[1]["pid"] != stop_pid, "the ranks must see other pids than the daemon's, or nothing is tested"


@pytest.mark.skipif(not shutil.which("unshare"), reason="needs util-linux's unshare")
def test_a_caller_outside_the_daemons_pid_namespace_may_not_hold_and_pidfds_stay_on(socket_dir):
    """A daemon in a pid namespace of its own is told pid 0 for callers outside it: it could never see
    them die, so a join or an agreement, which would leave them holding, is refused with the way out.
    Before, pidfd_open(0) turned pidfds off for every process, and pid 0 never read as dead."""
    d = Daemon(os.path.join(socket_dir, "peerd.sock"), Path(socket_dir) / "daemon.log",
               launcher=("unshare", "--pid", "--fork", "--kill-child=SIGTERM")).start()
    try:
        join = {"group": "far", "name": "n", "rank": 0, "npes": 2, "nbytes": 4096, "device": "host"}
        agree = {"group": "far", "rank": 0, "npes": 2, "ok": True}
        for op, body in (("join", join), ("agree", agree)):
            refused = call(d, op, body)
            assert refused["code"] == "FORBIDDEN" and "pid as 0" in refused["message"], refused
            assert "hostPID" in refused["message"] and f"no {op}" in refused["message"]
        status = json.loads(d.cli("status", "--json").stdout)
        assert status["liveness"] == "pidfd" and status["groups"] == 0, status
        assert "pidfd_open unavailable" not in d.logs()
    finally:
        os.kill(child_of(d.proc.pid), signal.SIGTERM)  # the daemon itself: unshare forwards no signal
        assert d.proc.wait(20) == 0, d.logs()
        assert not os.path.exists(d.socket), "socket left after shutdown"


def test_ctrl_c_in_the_constructor_leaves_nothing_held_and_the_process_may_join_again(daemon):
    """A Ctrl-C while the constructor waited for its peers left the rank joined until the process exited:
    its peers got the handles and waited out the agreement, and the same process joining again was refused
    RANK_TAKEN by its own pid. Now the interrupted join is released at once, a peer arriving hears why,
    and both join again."""
    rank = start_rank(daemon, "interruptible", 0, 2, "--group", "ctrl-c", "--timeout", "120", stdin=subprocess.PIPE)
    _line(rank, "READY")
    _say(rank)
    wait_until(joined(daemon, "ctrl-c", 0), 60, "rank 0 to join")
    rank.send_signal(signal.SIGINT)
    assert json.loads(_line(rank, "OUTCOME")[8:]) == {"interrupted": True}
    wait_until(lambda: _held(daemon) == [], 30, "the interrupted join to be released")
    assert rank.poll() is None, "released by the process that caught its Ctrl-C, not by its exit"
    peer = start_rank(daemon, "interruptible", 1, 2, "--group", "ctrl-c", "--timeout", "120", stdin=subprocess.PIPE)
    _line(peer, "READY")
    _say(peer)
    heard = json.loads(_line(peer, "OUTCOME")[8:])
    assert heard.get("code") == "GROUP_FAILED" and "withdrew" in heard["message"], heard
    for proc in (rank, peer):  # both join again
        _say(proc)
    for proc in (rank, peer):
        assert json.loads(_line(proc, "OUTCOME")[8:]) == {"joined": True}
    for proc in (rank, peer):
        _say(proc)
        finish(proc)
    wait_until(lambda: _held(daemon) == [], 30, "both ranks' releases")


def test_a_reload_that_raises_the_default_timeout_does_not_make_a_worker_give_up_first(socket_dir):
    config = Path(socket_dir) / "peerd.toml"
    config.write_text("rendezvous_timeout = 2\n")
    d = Daemon(os.path.join(socket_dir, "peerd.sock"), Path(socket_dir) / "daemon.log", args=("--config", str(config)))
    d.start()
    try:
        rank = start_rank(d, "patient", 0, 2, "--group", "reloaded", stdin=subprocess.PIPE)
        _line(rank, "READY")  # connected: it knows the 2 s default
        config.write_text("rendezvous_timeout = 60\n")
        d.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: "SIGHUP: reloaded" in d.logs(), 30, "the reload")
        _say(rank)
        outcome = json.loads(_line(rank, "OUTCOME")[8:])
        assert outcome["code"] == "TIMEOUT" and "timed out after" in outcome["message"], \
            f"the daemon's verdict, on the deadline the worker sent: {outcome}"
        _say(rank)
        finish(rank)
        assert _held(d) == []
    finally:
        assert d.stop() == 0, d.logs()


def test_ranks_that_close_while_the_daemon_is_stopped_are_released_once_it_resumes(daemon):
    ranks = [start_rank(daemon, "closer", r, 2, "--group", "stalled", stdin=subprocess.PIPE) for r in (0, 1)]
    for p in ranks:
        _line(p, "READY")
    daemon.proc.send_signal(signal.SIGSTOP)
    try:
        time.sleep(4.5)  # past the client's heartbeat: its connection is lost
        for p in ranks:
            _say(p)
        for p in ranks:
            _line(p, "CLOSED")  # close() returned at once, the daemon still stopped
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    wait_until(lambda: _held(daemon) == [] and daemon.settled_segments() == [], 30, "the set to be released")
    assert all(p.poll() is None for p in ranks), "released by the ranks' close(), not by their exit"
    assert "stalled" not in daemon.cli("ls").stdout
    for p in ranks:
        _say(p)
        assert finish(p)["closed"]


def test_pipelined_agreement_votes_are_false_or_refused_past_the_caps_and_the_daemon_stays_small(socket_dir):
    from peerd.quotas import MAX_AGREEMENTS_PER_UID, MAX_RUN_AHEAD

    d = Daemon(os.path.join(socket_dir, "peerd.sock"), Path(socket_dir) / "daemon.log",
               args=("--agreement-timeout", "600")).start()
    try:
        votes, groups = 20000, 2 * MAX_AGREEMENTS_PER_UID
        flooder = start_rank(d, "pipeline", 0, 2, "--group", "piped", "--votes", str(votes), "--hold", str(groups),
                             stdin=subprocess.PIPE)
        seen = json.loads(flooder.stdout.readline())
        # every vote past the run-ahead is False at once, and every group past the uid's caps refused
        # (a reply or two may be dropped by a full queue)
        assert set(seen["codes"]) == {"False", "LIMIT_EXCEEDED"} and seen["codes"]["False"] > votes // 2, seen
        examples = " ".join(seen["examples"].values())
        assert f"a rank may run at most {MAX_RUN_AHEAD} rounds ahead" in examples
        assert "agreement rounds unsettled" in examples
        rss_kib = int(next(line.split()[1] for line in open(f"/proc/{d.proc.pid}/status") if line.startswith("VmRSS")))
        assert rss_kib < 256 * 1024, f"daemon RSS {rss_kib} KiB under a pipelining flood"
        status = json.loads(d.cli("status", "--json").stdout)
        assert status["agreements_pending"] <= MAX_AGREEMENTS_PER_UID, "the daemon answers, with bounded state"
        assert "reached round 9 " in examples, "one group holds no more than its run-ahead"
        _say(flooder)
        finish(flooder)
        wait_until(lambda: json.loads(d.cli("status", "--json").stdout)["agreements_pending"] == 0, 30,
                   "the flooder's rounds to be dropped when it exits")
        after = run_ranks(d, "exchange", 2, "--group", "after-the-flood")
        assert all(r["ok"] for r in after), after
    finally:
        assert d.stop() == 0, d.logs()


def test_a_release_delivered_again_never_ends_the_next_set_of_the_same_rank(daemon):
    """A release retried after its first delivery (the client timed out on a stalled daemon, or the
    daemon restarted) names its set: the rank's next set of the same key keeps its hold and memory."""
    (r,) = run_ranks(daemon, "stale_release", 1, "--group", "kv", "--name", "cache")
    assert r["new_set"] and r["refused"] == "NOT_FOUND", r
    assert r["kept"] == 7, "the new set's memory was zeroed under its holder"


@pytest.mark.parametrize("op", ["drop", "close"])
def test_a_buffer_dropped_or_closed_while_another_thread_waits_in_a_call_is_released_at_once(daemon, op):
    """The finalizer's release waited up to 10 s for the thread holding the connection, then until that
    process's next call; close() waited behind that call for its whole timeout, and a Ctrl-C meanwhile
    lost its release for good (close() was a no-op after). Now the holder sends either from its wait,
    and neither the finalizer nor close() waits behind it."""
    group = f"{op}-busy"
    holder = start_rank(daemon, "dropped_while_busy", 1, 2, "--group", group, stdin=subprocess.PIPE)
    dropper = start_rank(daemon, "dropped_while_busy", 0, 2, "--group", group, "--timeout", "8", "--op", op)
    _line(holder, "READY")
    _line(dropper, "DROPPED")
    wait_until(lambda: [held for g, held in _held(daemon) if g == group] == [[1]], 5,
               "the daemon to hear rank 0's release while its other thread still waits")
    _say(holder)
    assert finish(holder)["ok"]
    result = finish(dropper, timeout=60)
    assert result["other_thread_still_waiting"] and result["lonely"] == {"code": "TIMEOUT"}, result


def test_a_queued_release_goes_out_while_another_thread_holds_the_new_connection(daemon):
    """A release the lost connection could not send waits for a new one; where another thread of the
    process held that one (a tp_agree waiting longer than the retry's wait), the retry took its refusal
    to wait for an answer of the daemon's and dropped the release: the set stayed held by the live
    worker for good. The holding thread sends it now."""
    group = "queued-busy"
    rank = start_rank(daemon, "released_behind_a_busy_thread", 0, 1, "--group", group, "--timeout", "20",
                      stdin=subprocess.PIPE)
    _line(rank, "READY")
    daemon.proc.send_signal(signal.SIGSTOP)  # past the heartbeat timeout: the worker's connection drops
    time.sleep(4.5)
    daemon.proc.send_signal(signal.SIGCONT)
    _say(rank)
    _line(rank, "CLOSED")
    wait_until(lambda: not [g for g, _ in _held(daemon) if g == group], 12,
               "the queued release, while the other thread still waits in its agreement")
    assert rank.poll() is None, "the other thread still waits"
    assert finish(rank)["verdicts"] == [False]


def test_close_never_waits_long_behind_a_daemon_loop_that_is_stuck(socket_dir):
    """A daemon whose loop is stuck (a hung driver call) still answers ZeroMQ's heartbeats, so its
    workers' connections stay up: each close() waited the full request timeout for its release's
    answer, 12 s a buffer. It waits RELEASE_WAIT_S now; the release, sent already, is sent again from
    the background until answered, and the daemon frees the sets once its loop runs again."""
    flag = Path(socket_dir) / "stall"
    d = Daemon(os.path.join(socket_dir, "peerd.sock"), Path(socket_dir) / "daemon.log",
               launcher=(sys.executable, str(HERE / "stalling_daemon.py")),
               daemon_env={"PEERD_TEST_STALL_FILE": str(flag)}).start()
    try:
        rank = start_rank(d, "closes_behind_a_stuck_loop", 0, 1, "--group", "stuck-loop", stdin=subprocess.PIPE)
        _line(rank, "READY")
        flag.touch()
        _say(rank)
        took = finish(rank, timeout=60)["took"]
        assert len(took) == 3 and max(took) < RELEASE_WAIT_S + 1.0 <= 3.0, took
        flag.unlink()
        wait_until(lambda: _held(d) == [], 30, "the releases, once the loop runs again")
    finally:
        flag.unlink(missing_ok=True)
        assert d.stop() == 0, d.logs()


def test_a_release_left_to_a_call_that_fails_still_goes_out(daemon):
    """A finalizer inside a call leaves its release to that call, which sent it only if it succeeded:
    after a failed call the release waited for the process's next call (forever, on the page path)."""
    group = "dropped-failed"
    holder = start_rank(daemon, "dropped_in_failed_call", 1, 2, "--group", group, stdin=subprocess.PIPE)
    dropper = start_rank(daemon, "dropped_in_failed_call", 0, 2, "--group", group, stdin=subprocess.PIPE)
    _line(holder, "READY")
    _line(dropper, "DROPPED")
    wait_until(lambda: [held for g, held in _held(daemon) if g == group] == [[1]], 5,
               "the daemon to hear rank 0's release although the call it was left to failed")
    for rank in (holder, dropper):
        _say(rank)
    assert finish(holder)["ok"]
    assert finish(dropper) == {"ok": True, "failed": "BAD_REQUEST"}
