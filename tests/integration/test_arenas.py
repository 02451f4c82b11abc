"""Per-(uid, device) arenas on the host backend: a real daemon, real worker processes, real users.

Chunks are kept here (--arena-idle-s), as a production daemon keeps them.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import urllib.request
from pathlib import Path

import pytest

from tests import arena_rank
from tests.conftest import Daemon, finish, local_users, start_rank, wait_until

KEEP = ("--arena-idle-s", "30")
SOCKET_GROUP, USER_A, USER_B = "pda-sock", "pda-a", "pda-b"


def keeping_daemon(socket_dir: str, *args: str) -> Daemon:
    """A host daemon that keeps empty chunks, on a socket other users can reach."""
    os.chmod(socket_dir, 0o755)
    return Daemon(os.path.join(socket_dir, "run", "peerd.sock"), Path(socket_dir) / "daemon.log",
                  args=KEEP + args).start()


@pytest.fixture
def keeping(socket_dir):
    d = keeping_daemon(socket_dir)
    yield d
    assert d.stop() == 0, d.logs()


@pytest.fixture(scope="module")
def users():
    """Two workers of the socket group: name -> uid:gid:socket gid."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create users (CI runs as root)")
    with local_users(SOCKET_GROUP, USER_A, USER_B) as specs:
        yield specs


def arenas(d: Daemon) -> list[dict]:
    (device,) = json.loads(d.cli("status", "--json").stdout)["devices"]
    return device["arenas"]


def finished(procs) -> list[dict]:
    results = [finish(p) for p in procs]
    assert all(r["ok"] for r in results), results
    return results


def let_go(holders) -> list[dict]:
    """Tell each holding rank to go on (a line on its stdin); their results, every one ok, in order."""
    for p in holders:
        p.stdin.write("go\n")
        p.stdin.flush()
    return finished(holders)


def test_a_second_set_of_one_uid_shares_the_chunk_and_needs_no_fd_and_no_open(keeping):
    for r in finished(arena_rank.start(keeping, "two_sets", 2, "--group", "pair")):
        assert r["same_chunk"] and r["apart"], r
        assert (r["driver_opens"], r["fd_fetches"]) == (0, 0), r
    (usage,) = arenas(keeping)
    assert (usage["chunks"], usage["handed_out_bytes"]) == (1, 0), "one chunk, kept empty after the release"
    assert len(keeping.segments()) == 1


def test_a_reused_buffer_reads_zero_after_being_dirtied(socket_dir):
    d = keeping_daemon(socket_dir, "--arena-chunk-bytes", "16KiB")  # the set fills it: the next set reuses it
    try:
        for r in finished(arena_rank.start(d, "reuse", 2, "--group", "dirty", "--nbytes", str(8 << 10))):
            assert r["same_range"], "the freed range must be the one handed out again, or nothing is tested"
            assert r["zero"], r
    finally:
        assert d.stop() == 0, d.logs()


def test_another_uid_never_gets_a_buffer_in_the_first_uids_chunk(socket_dir, users):
    keeping = keeping_daemon(socket_dir, "--socket-group", SOCKET_GROUP)
    holders = [start_rank(keeping, "join", r, 2, "--group", "mine", "--hold", "-1", "--as-user", users[name],
                          stdin=subprocess.PIPE) for name in (USER_A, USER_B) for r in (0, 1)]
    try:
        wait_until(lambda: keeping.logs().count("group=mine name=default live") == 2, 90, "both sets to go live")
        rows = arenas(keeping)
        uids = {int(users[n].split(":")[0]) for n in (USER_A, USER_B)}
        assert {row["uid"] for row in rows} == uids and all(row["chunks"] == 1 for row in rows), rows
        assert all(row["handed_out_bytes"] == 2 * (1 << 16) for row in rows), rows
        assert len(keeping.segments()) == 2, "one memfd per uid"
    finally:
        assert all(r["ok"] for r in let_go(holders))
        assert keeping.stop() == 0, keeping.logs()


def test_a_worker_dying_with_a_buffer_leaves_the_other_buffers_of_its_chunk_intact(keeping):
    kept = arena_rank.start(keeping, "keep", 2, "--group", "kept", stdin=subprocess.PIPE)
    wait_until(lambda: "group=kept name=kept live" in keeping.logs(), 90, "the kept set to go live")
    victims = [start_rank(keeping, "join", r, 2, "--group", "victim", "--nbytes", str(8 << 10), "--hold", "-1",
                          stdin=subprocess.PIPE) for r in (0, 1)]
    wait_until(lambda: "group=victim name=default live" in keeping.logs(), 90, "the victim set to go live")
    assert len(keeping.segments()) == 1, "both sets live in one chunk"
    os.kill(victims[0].pid, signal.SIGKILL)
    victims[0].wait()
    assert let_go(victims[1:])[0]["ok"]
    for r in finished(arena_rank.start(keeping, "reuse", 2, "--group", "after")):  # the freed range, dirtied again
        assert r["zero"], r
    for r in let_go(kept):
        assert r["intact"] == [True, True], r


def test_a_chunk_over_the_uid_cap_fails_only_that_join_naming_the_numbers(socket_dir):
    d = keeping_daemon(socket_dir, "--arena-chunk-bytes", "1MiB", "--arena-max-bytes-per-uid", "1MiB")
    try:
        holders = [start_rank(d, "join", r, 2, "--group", "fits", "--nbytes", str(512 << 10), "--hold", "-1",
                              stdin=subprocess.PIPE) for r in (0, 1)]
        wait_until(lambda: "group=fits name=default live" in d.logs(), 90, "the first set to go live")
        over = [finish(p) for p in [start_rank(d, "join", r, 2, "--group", "over", "--nbytes", "4096")
                                    for r in (0, 1)]]
        assert {r["code"] for r in over} == {"LIMIT_EXCEEDED"}, over
        assert any("uid 0 reserves 1048576 bytes (1.0 MiB) of arena chunks and a new one of 1048576 bytes "
                   "(1.0 MiB) on host would pass its cap of 1048576 bytes" in r["message"] for r in over), over
        assert all(r["ok"] for r in let_go(holders)), "the set already in the chunk is untouched"
    finally:
        assert d.stop() == 0, d.logs()


def test_a_daemon_restart_pulls_nothing_from_under_a_live_worker(keeping):
    kept = arena_rank.start(keeping, "keep", 2, "--group", "survivor", stdin=subprocess.PIPE)
    for p in kept:  # each holds its buffer (the daemon's "live" may be logged before its reply arrives)
        assert p.stdout.readline().strip() == "READY", p.stderr.read() if p.poll() is not None else ""
    keeping.proc.kill()
    keeping.proc.wait()
    keeping.start()
    assert arenas(keeping) == [], "a new daemon starts with no chunks and sweeps nothing"
    for r in let_go(kept):
        assert r["intact"] == [True, True], r


def test_status_ls_and_metrics_show_reserved_against_handed_out_bytes(socket_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = keeping_daemon(socket_dir, "--metrics-port", str(port))
    try:
        holders = [start_rank(d, "join", r, 2, "--group", "shown", "--nbytes", "5000", "--hold", "-1",
                              stdin=subprocess.PIPE) for r in (0, 1)]
        wait_until(lambda: "group=shown name=default live" in d.logs(), 90, "the set to go live")
        assert "arena of uid 0: 1 chunk(s), 64.0 MiB reserved, 16.0 KiB handed out" in d.cli("status").stdout
        assert "host: arena of uid 0: 1 chunk(s), 64.0 MiB reserved, 16.0 KiB handed out" in d.cli("ls").stdout
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert 'peerd_arena_reserved_bytes{device="host",uid="0"} 6.7108864e+07' in text, text
        assert 'peerd_arena_handed_out_bytes{device="host",uid="0"} 16384.0' in text, text
        assert all(r["ok"] for r in let_go(holders))
    finally:
        assert d.stop() == 0, d.logs()
