"""Access control and limits, with a second real Unix user (CI runs as root)."""

from __future__ import annotations

import grp
import json
import os
import pwd
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import Daemon, finish, local_users, run_ranks, start_rank, wait_until

USER, OTHER_USER, SOCKET_GROUP = "pdc-probe", "pdc-probe2", "pdc-sock"
MiB = 1 << 20

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create a second user (CI runs as root)")


@pytest.fixture(scope="module")
def probe_user():
    """A second user, member of the socket group: (uid, gid, socket gid). Removed afterwards."""
    with local_users(SOCKET_GROUP, USER, OTHER_USER):
        user = pwd.getpwnam(USER)
        yield user.pw_uid, user.pw_gid, grp.getgrnam(SOCKET_GROUP).gr_gid


def as_user(user) -> tuple[str, str]:
    uid, gid, sock_gid = user
    return ("--as-user", f"{uid}:{gid}:{sock_gid}")


def daemon_with(socket_dir: str, *args: str) -> Daemon:
    """A root daemon on a socket in a directory it creates, which other users can reach."""
    os.chmod(socket_dir, 0o755)
    return Daemon(os.path.join(socket_dir, "run", "peerd.sock"), Path(socket_dir) / "daemon.log", args=args).start()


def call(daemon, op, body, *extra, rank=0):
    return run_ranks(daemon, "call", 1, "--op", op, "--body", json.dumps(body), *extra, ranks=[rank])[0]


def test_a_directory_mode_that_keeps_the_socket_group_out_or_is_not_applied_is_said(socket_dir, probe_user):
    """--socket-dir-mode 0700 with a socket group made a directory its members could not enter, without a
    word; a mode for a directory that already existed (the shipped unit's /run/peerd) was silently unused.
    A directory the daemon made goes at its stop: a root daemon's /run/peerd (0750), left behind, read as
    the node's daemon to every other user's default socket (peerd.paths.default_socket) after it stopped."""
    directory = os.path.join(socket_dir, "run")
    d = daemon_with(socket_dir, "--socket-group", SOCKET_GROUP, "--socket-dir-mode", "0700")
    assert d.stop() == 0
    assert f"is made with mode 0700 (--socket-dir-mode), which keeps the members of the socket group {SOCKET_GROUP}" \
        " out" in d.logs(), d.logs()
    assert not os.path.exists(directory), "the directory it made went at its stop"
    os.mkdir(directory, 0o700)  # one made by someone else: the shipped unit's /run/peerd
    d = daemon_with(socket_dir, "--socket-dir-mode", "0750")
    assert d.stop() == 0
    assert "exists with mode 0700: --socket-dir-mode 0750 applies only to a directory the daemon creates" in d.logs()
    assert os.listdir(directory) == [], "a directory it did not make stays, emptied of what the daemon put there"


def test_socket_and_directory_modes_and_group(socket_dir, probe_user):
    d = daemon_with(socket_dir, "--socket-group", SOCKET_GROUP)
    try:
        directory, sock = os.stat(os.path.dirname(d.socket)), os.stat(d.socket)
        assert stat.S_IMODE(directory.st_mode) == 0o750 and directory.st_gid == probe_user[2]
        assert stat.S_IMODE(sock.st_mode) == 0o660 and sock.st_gid == probe_user[2]
    finally:
        assert d.stop() == 0


@pytest.mark.parametrize("setup, words", [
    (lambda path: os.chown(path, 65534, 65534), "is owned by uid 65534"),
    (None, "'0770' lets other users write to the socket's directory"),
])
def test_refuses_a_socket_directory_others_could_write_to(socket_dir, setup, words):
    target = os.path.join(socket_dir, "shared")
    os.mkdir(target)
    args = ["--socket", os.path.join(target, "peerd.sock")]
    if setup:
        setup(target)
    else:
        args += ["--socket-dir-mode", "0770"]
    result = subprocess.run([sys.executable, "-m", "peerd", "serve", "--backend", "host", *args],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode != 0 and words in result.stderr, result.stderr
    assert not os.path.exists(os.path.join(target, "peerd.sock"))


def test_a_shared_sticky_directory_is_refused_without_advice_to_chmod_it(socket_dir):
    """peerd serve --socket /tmp/x.sock advised `chmod go-w /tmp`, which would break the machine."""
    shared = os.path.join(socket_dir, "tmp")
    os.mkdir(shared)
    os.chmod(shared, 0o1777)
    result = subprocess.run([sys.executable, "-m", "peerd", "serve", "--backend", "host", "--socket",
                             os.path.join(shared, "peerd.sock")], capture_output=True, text=True, timeout=30)
    assert result.returncode != 0 and "is writable by other users" in result.stderr, result.stderr
    assert "chmod" not in result.stderr and f"(e.g. {shared}/peerd/peerd.sock)" in result.stderr, result.stderr


def test_the_allowlist_refuses_another_user_once_per_connection(socket_dir, probe_user):
    d = daemon_with(socket_dir, "--socket-group", SOCKET_GROUP, "--allow-gid", "root")
    try:
        result = run_ranks(d, "agree", 1, "--group", "outsider", "--votes", "1,1,1", *as_user(probe_user))[0]
        assert result["code"] == "FORBIDDEN" and f"uid {probe_user[0]}" in result["message"], result
        again = run_ranks(d, "agree", 1, "--group", "outsider", "--votes", "1", *as_user(probe_user))[0]
        assert again["code"] == "FORBIDDEN"
        refusals = [line for line in d.logs().splitlines() if "not in the allowlist" in line]
        assert len(refusals) == 2, "one log line per connection (two processes), not one per message"
    finally:
        assert d.stop() == 0


def test_a_refused_user_cycling_connections_costs_a_few_log_lines_not_one_each(socket_dir, probe_user):
    """Each refused connection was a warning of its own: a user in the socket group but outside the
    allowlist wrote 3000 lines in a second. The first few of an interval name their pid; the rest are
    counted, a line per uid."""
    d = daemon_with(socket_dir, "--socket-group", SOCKET_GROUP, "--allow-gid", "root")
    try:
        result = run_ranks(d, "connections", 1, "--hold", "40", *as_user(probe_user))[0]
        assert result["codes"] == ["FORBIDDEN"] * 40, result
        refusals = [line for line in d.logs().splitlines() if "not in the allowlist" in line]
        assert len(refusals) == 10 and f"(uid {probe_user[0]}," in refusals[0], refusals
    finally:
        assert d.stop() == 0


def test_a_caller_the_allowlist_refuses_gets_status_and_ls_exit_3_with_the_reason(socket_dir, probe_user):
    """A probe run as a refused user must not read as degraded (1), nor get a traceback: it cannot read
    the daemon's health, which is what 3 means to it."""
    uid, gid, sock_gid = probe_user
    d = daemon_with(socket_dir, "--socket-group", SOCKET_GROUP, "--allow-gid", "root")
    try:
        for command in ("status", "ls"):
            result = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "as_user.py"),
                                     f"{uid}:{gid}:{sock_gid}", command], env=d.env(), capture_output=True,
                                    text=True, timeout=30)
            assert result.returncode == 3, (command, result.returncode, result.stderr)
            assert "refused (FORBIDDEN)" in result.stderr and f"uid {uid}" in result.stderr, result.stderr
            assert "Traceback" not in result.stderr, result.stderr
    finally:
        assert d.stop() == 0


@pytest.mark.parametrize("allow", [(), ("--allow-uid", "PROBE")])
def test_the_socket_group_or_an_allowed_uid_is_admitted(socket_dir, probe_user, allow):
    allow = tuple(str(probe_user[0]) if a == "PROBE" else a for a in allow)
    d = daemon_with(socket_dir, "--socket-group", SOCKET_GROUP, *allow)
    try:
        result = run_ranks(d, "exchange", 2, "--group", "guest", *as_user(probe_user))
        assert all(r["ok"] for r in result), result
        assert d.settled_segments() == []
    finally:
        assert d.stop() == 0


def test_another_process_cannot_take_fetch_vote_or_release_a_rank(socket_dir, probe_user):
    d = daemon_with(socket_dir, "--socket-group", SOCKET_GROUP)
    try:
        holders = [start_rank(d, "join", r, 2, "--group", "owned", "--hold", "60") for r in (0, 1)]
        wait_until(lambda: "group=owned name=default live" in d.logs(), 90, "the set to go live")
        slot = {"group": "owned", "name": "default", "rank": 0}
        join = {**slot, "npes": 2, "nbytes": 65536, "device": "host"}
        taken = call(d, "join", join)
        assert taken["code"] == "RANK_TAKEN" and "reply" not in taken, "no handles to a non-member"
        vote = call(d, "commit", {**slot, "ok": True})
        assert vote["code"] == "NOT_MEMBER" and f"belongs to pid {holders[0].pid}" in vote["message"]
        release = call(d, "release", slot)
        assert release["code"] == "NOT_MEMBER"
        (entry,) = json.loads(d.cli("ls", "--json").stdout)
        assert entry["held"] == [0, 1] and entry["state"] == "live", "the group is untouched"

        # a rendezvous and an agreement of root's, each waiting for rank 1
        waiting = [start_rank(d, "join", 0, 2, "--group", "pending", "--hold", "60"),
                   start_rank(d, "agree", 0, 2, "--group", "voting", "--votes", "1")]
        wait_until(lambda: "group=pending name=default rank=0" in d.logs(), 90, "rank 0 to join")
        # another user's join and vote land in groups of her own namespace: root's wait on
        intruder = call(d, "join", {**join, "group": "pending", "rank": 1, "timeout": 2}, *as_user(probe_user), rank=1)
        assert intruder["code"] == "TIMEOUT" and "rank(s) [0] of 2 never joined" in intruder["message"], intruder
        pending = [e for e in json.loads(d.cli("ls", "--json").stdout) if e["group"] == "pending"]
        assert sorted((e["uid"], e["state"], e["joined"], e["held"]) for e in pending) == [
            (0, "joining", [0], [0]), (probe_user[0], "failed", [1], [])], "root's set is untouched"
        wait_until(lambda: call(d, "agree", {"group": "voting", "rank": 0, "npes": 2, "ok": True})["code"]
                   == "NOT_MEMBER", 30, "rank 0's vote to register")
        stolen = call(d, "agree", {"group": "voting", "rank": 1, "npes": 2, "ok": False, "timeout": 2},
                      *as_user(probe_user))
        assert stolen["reply"]["ok"] is False and "timed out" in stolen["reply"]["reason"], stolen
        voter = start_rank(d, "agree", 1, 2, "--group", "voting", "--votes", "1")
        assert finish(voter)["results"] == [True] and finish(waiting[1])["results"] == [True], \
            "root's round counted root's votes only"
        for p in holders + waiting:
            p.kill()
    finally:
        assert d.stop() == 0


def test_two_users_use_the_same_key_at_once_each_in_a_namespace_of_their_own(socket_dir, probe_user):
    uid, gid, sock_gid = probe_user
    other = pwd.getpwnam(OTHER_USER)
    users = {uid: f"{uid}:{gid}:{sock_gid}", other.pw_uid: f"{other.pw_uid}:{other.pw_gid}:{sock_gid}"}
    d = daemon_with(socket_dir, "--socket-group", SOCKET_GROUP)
    try:
        holders = {u: [start_rank(d, "join", r, 2, "--group", "same-key", "--hold", "-1", "--as-user", spec,
                                  stdin=subprocess.PIPE) for r in (0, 1)] for u, spec in users.items()}
        wait_until(lambda: d.logs().count("group=same-key name=default live") == 2, 90, "both sets to go live")
        everyone = json.loads(d.cli("ls", "--json").stdout)
        assert sorted((e["uid"], e["state"], e["held"]) for e in everyone) == [
            (uid, "live", [0, 1]), (other.pw_uid, "live", [0, 1])]
        own = call(d, "ls", {}, "--as-user", users[uid])["reply"]["groups"]
        assert [e["uid"] for e in own] == [uid], "a user sees her own sets only"
        result = d.cli("evict", "same-key", "--uid", str(uid), "--yes")
        assert result.returncode == 0 and f"of uid {uid}" in result.stdout, result
        (left,) = json.loads(d.cli("ls", "--json").stdout)
        assert left["uid"] == other.pw_uid and left["held"] == [0, 1], "the other user's set stays"
        for p in holders[uid] + holders[other.pw_uid]:
            p.stdin.write("go\n")
            p.stdin.flush()
            assert finish(p)["ok"]
        assert json.loads(d.cli("ls", "--json").stdout) == [] and d.settled_segments() == []
    finally:
        assert d.stop() == 0, d.logs()


def test_each_limit_is_a_clear_error_before_anything_is_allocated(socket_dir):
    d = daemon_with(socket_dir, "--max-buffer-bytes", "1MiB", "--max-ranks", "4", "--max-groups", "2",
                    "--max-bytes-per-uid", "3MiB")
    try:
        big = run_ranks(d, "join", 2, "--group", "big", "--nbytes", str(2 * MiB), ranks=[0])[0]
        assert big["code"] == "LIMIT_EXCEEDED"
        assert ("nbytes=2097152 (2.0 MiB) exceeds the daemon's limit of 1048576 bytes (1.0 MiB) per buffer "
                "(--max-buffer-bytes)") in big["message"], big
        wide = run_ranks(d, "join", 8, "--group", "wide", ranks=[0])[0]
        assert wide["code"] == "LIMIT_EXCEEDED" and "npes=8 exceeds the daemon's limit of 4 ranks" in wide["message"]
        holders = [start_rank(d, "join", r, 2, "--group", f"g{g}", "--nbytes", str(MiB), "--hold", "60")
                   for g in (1,) for r in (0, 1)]
        wait_until(lambda: "group=g1 name=default live" in d.logs(), 90, "g1 to go live")
        late = [start_rank(d, "join", r, 2, "--group", "g2", "--nbytes", str(MiB), "--timeout", "5") for r in (0, 1)]
        results = [finish(p) for p in late]
        assert {r["code"] for r in results} == {"LIMIT_EXCEEDED"}, results
        assert any("uid 0 holds 3145728 bytes and asks for 1048576 more, over its limit of 3145728" in r["message"]
                   for r in results), results
        (device,) = json.loads(d.cli("status", "--json").stdout)["devices"]
        assert [a["handed_out_bytes"] for a in device["arenas"]] == [2 * MiB], \
            "only g1 holds memory: nothing past the limit, g2 freed when it failed"
        third = start_rank(d, "join", 0, 2, "--group", "g3", "--nbytes", "4096", "--hold", "60")
        wait_until(lambda: "group=g3 name=default rank=0" in d.logs(), 90, "g3 to start")
        over = run_ranks(d, "join", 2, "--group", "g4", "--nbytes", "4096", ranks=[0])[0]
        assert over["code"] == "LIMIT_EXCEEDED" and "already holds 2 buffer sets (--max-groups 2)" in over["message"]
        for p in holders + [third]:
            p.kill()
    finally:
        assert d.stop() == 0


@pytest.mark.parametrize("routing_id", [None, b"victim", b"\x00" + bytes(15)], ids=["made-up", "short", "zero-led"])
def test_a_connection_another_user_could_take_the_name_of_is_answered_nothing_but_bad_request(daemon, routing_id):
    """Replies go to a routing id, and a user may claim any id that is free: a reply owed to a connection
    that went away went to whoever claimed its id next (a join reply's handles open the buffers). The daemon
    serves only names nobody can guess (peerd.routingids): these get BAD_REQUEST, and no set is made."""
    import zmq

    from peerd.protocol import decode_reply, encode_request

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if routing_id is not None:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.connect(f"ipc://{daemon.socket}")
    try:
        sock.send(encode_request(1, "join", {"group": "named", "name": "default", "rank": 0, "npes": 1,
                                             "nbytes": 4096, "device": "host", "flags": 0, "timeout": 5.0}))
        assert sock.poll(10_000), "no answer"
        reply = decode_reply(sock.recv())
    finally:
        sock.close()
    assert not reply.ok and reply.error.code.value == "BAD_REQUEST", reply
    assert "ZMQ_ROUTING_ID" in reply.error.message and "another user could take it" in reply.error.message
    assert "no buffer sets" in daemon.cli("ls").stdout


def test_the_byte_limits_count_a_buffer_as_it_is_allocated_aligned(socket_dir):
    """A buffer takes its size rounded up to 4 KiB: checking the asked size let a uid hold up to 4095
    bytes a buffer past --max-bytes-per-uid, counted past it in status."""
    d = daemon_with(socket_dir, "--max-bytes-per-uid", "10000")
    try:
        over = run_ranks(d, "join", 1, "--group", "odd", "--nbytes", "9000", ranks=[0])[0]
        assert over["code"] == "LIMIT_EXCEEDED", over
        assert "uid 0 holds 0 bytes and asks for 12288 more, over its limit of 10000" in over["message"], over
        (fits,) = run_ranks(d, "join", 1, "--group", "even", "--nbytes", "8192")
        assert fits["ok"], fits
    finally:
        assert d.stop() == 0


def test_the_device_limit(socket_dir):
    d = daemon_with(socket_dir, "--max-bytes-per-device", "1MiB")
    try:
        results = run_ranks(d, "join", 2, "--group", "dev", "--nbytes", str(MiB // 2 + 1))
        assert {r["code"] for r in results} == {"LIMIT_EXCEEDED"}
        assert any("device host holds" in r["message"] and "over its limit of 1048576" in r["message"]
                   for r in results)
    finally:
        assert d.stop() == 0


def test_evict_frees_a_stuck_group_warns_and_is_for_admins_only(socket_dir, probe_user):
    d = daemon_with(socket_dir, "--socket-group", SOCKET_GROUP)
    try:
        holders = [start_rank(d, "join", r, 2, "--group", "stuck", "--hold", "-1", stdin=subprocess.PIPE)
                   for r in (0, 1)]
        wait_until(lambda: "group=stuck name=default live" in d.logs(), 90, "the set to go live")
        refused = call(d, "evict", {"group": "stuck"}, *as_user(probe_user))
        assert refused["code"] == "FORBIDDEN" and "only root or uid" in refused["message"]
        uid, gid, sock_gid = probe_user  # the command refuses at once: no warning, no question first
        asked = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "as_user.py"), f"{uid}:{gid}:{sock_gid}",
                                "evict", "stuck", "--socket", d.socket], input="y\n", capture_output=True, text=True,
                               env=d.env(), timeout=60)
        assert asked.returncode == 1 and "WARNING" not in asked.stderr and "[y/N]" not in asked.stderr, asked
        assert f"only root or the daemon's user (uid 0) may evict; uid {uid} may not" in asked.stderr, asked
        result = d.cli("evict", "stuck", "--yes")
        assert result.returncode == 0, result.stderr
        assert "WARNING" in result.stderr and str(holders[0].pid) in result.stderr
        assert "evicted group=stuck name=default" in result.stdout
        assert d.settled_segments() == [] and json.loads(d.cli("ls", "--json").stdout) == []
        assert "evicts group=stuck" in d.logs() and "may still touch its memory until they exit" in d.logs()
        assert d.cli("evict", "stuck", "--yes").returncode == 1, "nothing left to evict"
        for p in holders:  # now they close, after the eviction
            p.stdin.write("go\n")
            p.stdin.flush()
            assert finish(p)["ok"], "a holder's late close after an eviction must not crash it"
    finally:
        assert d.stop() == 0


def test_a_daemon_running_as_its_own_user_serves_another_user_of_its_socket_group(socket_dir, probe_user):
    """The systemd layout: the daemon is not root, the workers are another user of the socket group. A
    metrics port it may not bind (below 1024) is said to be that, not held by another user (and not
    tried again every few seconds)."""
    uid, gid, sock_gid = probe_user
    other = pwd.getpwnam(OTHER_USER)
    os.chown(socket_dir, uid, gid)
    os.chmod(socket_dir, 0o755)
    d = Daemon(os.path.join(socket_dir, "run", "peerd.sock"), Path(socket_dir) / "daemon.log",
               extra_env={"PEERD_DAEMON_USER": USER})  # the workers trust this daemon's user
    d.proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).parents[1] / "as_user.py"), f"{uid}:{gid}:{sock_gid}", "serve",
         "--backend", "host", "--socket", d.socket, "--socket-group", SOCKET_GROUP, "--metrics-port", "1"],
        stdout=open(d.log, "ab"), stderr=subprocess.STDOUT, env=d.env())
    wait_until(lambda: "serving" in d.logs() or d.proc.poll() is not None, 60, "the daemon to start")
    try:
        assert "cannot listen on 127.0.0.1:1 (Permission denied): ports below 1024 need root or " \
               "CAP_NET_BIND_SERVICE" in d.logs() and "trying the port again" not in d.logs(), d.logs()
        shown = d.cli("status")  # and to every probe: a log line alone went unseen
        assert shown.returncode == 1 and "problem: metrics (--metrics-port): cannot listen on 127.0.0.1:1 " \
               "(Permission denied): ports below 1024" in shown.stdout, shown.stdout
        results = run_ranks(d, "exchange", 2, "--group", "shared", "--as-user",
                            f"{other.pw_uid}:{other.pw_gid}:{sock_gid}")
        assert all(r["ok"] for r in results), results
        assert d.settled_segments() == [], "the daemon freed every buffer"
    finally:
        assert d.stop() == 0, d.logs()


def test_a_socket_group_the_daemon_may_not_give_is_named_and_nothing_is_left_behind(socket_dir, probe_user):
    """A daemon neither in its socket group nor holding CAP_CHOWN (a hand-run daemon, the DaemonSet that
    drops every capability) stopped on a bare '[Errno 1] Operation not permitted', and left its socket
    directory behind in its own group, which then kept the next start from working either."""
    uid, gid, _ = probe_user
    os.chown(socket_dir, uid, gid)
    os.chmod(socket_dir, 0o755)
    run_dir = Path(socket_dir) / "run"
    for attempt in range(2):
        done = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "as_user.py"), f"{uid}:{gid}", "serve",
                               "--backend", "host", "--socket", str(run_dir / "peerd.sock"), "--socket-group",
                               SOCKET_GROUP], capture_output=True, text=True, timeout=60)
        assert done.returncode == 1 and "[Errno" not in done.stderr, (attempt, done.stderr)
        assert f"may not give its socket to the socket group {SOCKET_GROUP}" in done.stderr, done.stderr
        assert "it is not a member and lacks CAP_CHOWN" in done.stderr, done.stderr
        assert not run_dir.exists(), "the directory this start made is gone with it"
    run_dir.mkdir(mode=0o750)  # one that exists already (the unit's /run/peerd): found at the lock, before any GPU
    os.chown(run_dir, uid, gid)
    done = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "as_user.py"), f"{uid}:{gid}", "serve",
                           "--backend", "cuda", "--socket", str(run_dir / "peerd.sock"), "--socket-group",
                           SOCKET_GROUP], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and f"may not give its socket to the socket group {SOCKET_GROUP}" in done.stderr \
        and "cuda-bindings" not in done.stderr, done.stderr
    assert os.listdir(run_dir) == [], "no socket, no lock file left"
