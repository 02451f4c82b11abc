"""The CLI as a user runs it: a subprocess against a real daemon."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.conftest import Daemon, finish, memfd_holders, run_ranks, start_rank, wait_until


def test_status_answers_with_a_summary_and_json(daemon):
    human = daemon.cli("status")
    assert human.returncode == 0, human.stderr
    assert "healthy" in human.stdout and "backend host" in human.stdout
    info = json.loads(daemon.cli("status", "--json").stdout)
    assert info["backend"] == "host" and info["pid"] == daemon.proc.pid and info["socket"] == daemon.socket
    assert info["devices"][0]["uuid"] == "host"


def test_status_without_a_daemon_fails_with_one_line(socket_dir):
    result = subprocess.run(
        [sys.executable, "-m", "peerd", "status", "--socket", f"{socket_dir}/none.sock"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 3
    assert result.stderr.count("\n") == 1 and "no peerd daemon socket" in result.stderr


def test_ls_shows_each_group_while_it_is_held(daemon):
    holders = [start_rank(daemon, "join", r, 2, "--group", "shown", "--name", "kv", "--hold", "30") for r in (0, 1)]
    wait_until(lambda: "group=shown name=kv live" in daemon.logs(), 90, "the set to go live")
    listing = json.loads(daemon.cli("ls", "--json").stdout)
    assert len(listing) == 1
    entry = listing[0]
    assert (entry["group"], entry["name"], entry["state"], entry["npes"]) == ("shown", "kv", "live", 2)
    assert entry["joined"] == [0, 1] and sorted(entry["pids"].values()) == sorted(p.pid for p in holders)
    human = daemon.cli("ls").stdout
    assert "shown" in human and "kv" in human and "2/2" in human and "live" in human
    for p in holders:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)


def test_ls_pages_through_every_set_of_a_key_one_at_a_time(daemon):
    """A key with two sets (a left set its peer still holds, and the one joining in its place): a page of
    one set at a time lists both, as `status` counts them (the cursor named no set, and skipped the second)."""
    from peerd_client.connection import Connection

    holder = start_rank(daemon, "join", 1, 2, "--group", "twice", "--hold", "-1", stdin=subprocess.PIPE)
    finish(start_rank(daemon, "join", 0, 2, "--group", "twice"))  # leaves the live set to its peer
    again = start_rank(daemon, "join", 0, 2, "--group", "twice", "--timeout", "60")
    conn = Connection(daemon.socket)
    try:
        wait_until(lambda: f"rank=0 pid={again.pid} joined" in daemon.logs(), 60, "the second join")
        seen, after = [], None
        while True:
            page = conn.call("ls", {"after": after, "limit": 1})
            seen += page["groups"]
            if not page["more"]:
                break
            last = seen[-1]
            after = [last["group"], last["name"], last["uid"], last["set"]]
        assert sorted(e["state"] for e in seen) == ["joining", "live"], seen
        assert [e["group"] for e in json.loads(daemon.cli("ls", "--json").stdout)] == ["twice", "twice"]
    finally:
        conn.close()
        for proc in (holder, again):
            proc.kill()
            proc.wait()


def test_a_second_daemon_on_the_same_socket_refuses_to_start(daemon):
    second = subprocess.run(
        [sys.executable, "-m", "peerd", "serve", "--backend", "host", "--socket", daemon.socket],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert second.returncode != 0
    assert f"another peerd (pid {daemon.proc.pid}) already serves this socket" in second.stderr
    assert daemon.cli("status").returncode == 0, "the first daemon must keep its socket"


def test_sigterm_frees_everything_and_removes_the_socket(socket_dir):
    d = Daemon(os.path.join(socket_dir, "peerd.sock"), Path(socket_dir) / "log").start()
    waiting = start_rank(d, "join", 0, 2, "--group", "cut")
    wait_until(lambda: "group=cut name=default rank=0" in d.logs(), 90, "rank 0 to join")
    held = set(d.segments())
    assert len(held) == 1
    assert d.stop() == 0
    result = finish(waiting)
    assert result["code"] == "SHUTTING_DOWN", result
    assert not os.path.exists(d.socket) and not os.path.exists(d.socket + ".lock")
    assert not os.path.exists(d.socket + ".fd")
    assert not memfd_holders(held), "the memory is gone with the daemon"


def test_python_dash_m_peerd_is_the_same_cli():
    result = subprocess.run([sys.executable, "-m", "peerd", "--help"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0
    for command in ("serve", "status", "ls"):
        assert command in result.stdout


def test_control_characters_are_refused_in_keys_and_escaped_in_logs_and_ls(daemon):
    for group in ("two\nlines", "clear\x1b[2J"):
        body = {"group": group, "name": "n", "rank": 0, "npes": 1, "nbytes": 64, "device": "host"}
        (refused,) = run_ranks(daemon, "call", 1, "--op", "join", "--body", json.dumps(body))
        assert refused["code"] == "BAD_REQUEST" and "control character" in refused["message"], refused
    # a commit reason is free text: it reaches the log and `peerd ls`, escaped
    forged = "x\n2026-01-01 00:00:00,000 INFO peerd.server: forged\x1b[2J\x1b]0;title\x07"
    voters = [start_rank(daemon, "vote", r, 2, "--group", "inject", "--votes", v, "--body",
                         json.dumps({"reason": forged}), stdin=subprocess.PIPE) for r, v in ((0, "0"), (1, "1"))]
    for p in voters:
        assert p.stdout.readline().strip() == "VOTED"
    log = daemon.logs()
    assert "failed its agreement: rank 0: x\\n2026-01-01 00:00:00,000 INFO peerd.server: forged\\x1b[2J" in log
    assert not [line for line in log.splitlines() if line.startswith("2026-01-01")], "no forged log line"
    assert "\x1b" not in log and "\x07" not in log
    shown = daemon.cli("ls")
    assert shown.returncode == 0 and "forged\\x1b[2J\\x1b]0;title\\x07" in shown.stdout, shown.stdout
    assert "\x1b" not in shown.stdout and "\x07" not in shown.stdout
    assert len(shown.stdout.splitlines()) == 4, "the header, the set, why it failed, the arena: no line forged"
    for p in voters:
        p.stdin.write("done\n")
        p.stdin.flush()
        assert finish(p)["ok"]
