"""Whom the client and the daemon trust with the socket path, with real extra users (CI runs as root).

pdt-x plays the hostile local user, pdt-y the worker she attacks.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq

from peerd import protocol
from peerd_client.connection import Connection
from peerd_client.errors import DaemonUnavailable
from tests.conftest import HERE, Daemon, child_of, wait_until

ATTACKER, VICTIM, GROUP = "pdt-x", "pdt-y", "pdt-g"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create users (CI runs as root)")


@pytest.fixture(scope="module")
def users():
    """pdt-x and pdt-y, and a group pdt-g neither is in: name -> pwd entry. Removed afterwards."""
    remove = [["userdel", ATTACKER], ["userdel", VICTIM], ["groupdel", GROUP]]
    for command in remove:  # left by an earlier run that was killed
        subprocess.run(command, check=False, capture_output=True)
    subprocess.run(["groupadd", GROUP], check=True)
    for name in (ATTACKER, VICTIM):
        subprocess.run(["useradd", "--no-create-home", "--user-group", "--shell", "/usr/sbin/nologin", name],
                       check=True)
    yield {name: pwd.getpwnam(name) for name in (ATTACKER, VICTIM)}
    for command in remove:
        subprocess.run(command, check=False)


@pytest.fixture
def reachable_dir(socket_dir):
    """The test's directory, which other users may pass through."""
    os.chmod(socket_dir, 0o755)
    return Path(socket_dir)


def ids(user) -> str:
    return f"{user.pw_uid}:{user.pw_gid}"


def serve_as(user, socket: str, log: Path, *args: str) -> Daemon:
    """A real `peerd serve` running as user, started once it says it serves."""
    d = Daemon(socket, log)
    d.proc = subprocess.Popen(
        [sys.executable, str(HERE / "as_user.py"), ids(user), "serve", "--backend", "host", "--socket", socket, *args],
        stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=d.env())
    wait_until(lambda: "serving" in d.logs() or d.proc.poll() is not None, 60, "the daemon to start")
    assert d.proc.poll() is None, d.logs()
    return d


def serve(*args: str) -> subprocess.CompletedProcess:
    """`peerd serve` as root that is expected to refuse."""
    return subprocess.run([sys.executable, "-m", "peerd", "serve", "--backend", "host", *args],
                          capture_output=True, text=True, timeout=60)


def hello(user=None, **env: str) -> dict:
    """A worker's first call, as user (root by default) with exactly the peerd variables given."""
    clean = {k: v for k, v in os.environ.items() if k not in ("PEERD_SOCKET", "XDG_RUNTIME_DIR", "PEERD_DAEMON_USER")}
    as_user = ["--as-user", ids(user)] if user else []
    done = subprocess.run(
        [sys.executable, str(HERE / "rank.py"), "call", "--rank", "0", "--npes", "1", "--op", "hello", *as_user],
        capture_output=True, text=True, timeout=120, env={**clean, "PEERD_CONNECT_TIMEOUT": "5", **env})
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, done.stderr
    return json.loads(lines[-1])


def test_an_impostor_at_the_default_path_is_refused_naming_its_owner(users, reachable_dir):
    """pdt-x serves a daemon at /tmp/peerd-<uid of pdt-y>; pdt-y's worker, told no socket, must not use it."""
    if os.path.exists("/run/peerd/peerd.sock"):
        pytest.skip("a system daemon runs here: workers would find /run/peerd/peerd.sock first")
    attacker, victim = users[ATTACKER], users[VICTIM]
    squatted = f"/tmp/peerd-{victim.pw_uid}"
    shutil.rmtree(squatted, ignore_errors=True)
    impostor = serve_as(attacker, f"{squatted}/peerd.sock", reachable_dir / "impostor.log",
                        "--socket-dir-mode", "0755", "--allow-uid", str(victim.pw_uid))
    try:
        result = hello(victim)
        assert result["type"] == "DaemonUnavailable" and result["code"] == "UNTRUSTED_DAEMON", result
        assert f"{squatted} is owned by uid {attacker.pw_uid} ({ATTACKER})" in result["message"], result
    finally:
        assert impostor.stop() == 0, impostor.logs()
        shutil.rmtree(squatted, ignore_errors=True)


def test_a_daemon_of_an_untrusted_uid_is_refused_after_hello_unless_named_as_the_daemon_user(users, reachable_dir):
    """The path looks like root's (root chowned it), but the kernel says pdt-x answers."""
    attacker, victim = users[ATTACKER], users[VICTIM]
    home = reachable_dir / "x"
    home.mkdir(mode=0o755)
    os.chown(home, attacker.pw_uid, attacker.pw_gid)
    socket = home / "run" / "peerd.sock"
    d = serve_as(attacker, str(socket), reachable_dir / "x.log", "--allow-uid", str(victim.pw_uid))
    disguised = (home, home / "run", socket)
    try:
        for path in disguised:
            os.chown(path, 0, 0, follow_symlinks=False)
        os.chmod(home / "run", 0o755)
        os.chmod(socket, 0o666)
        refused = hello(victim, PEERD_SOCKET=str(socket))
        assert refused["type"] == "DaemonUnavailable" and refused["code"] == "UNTRUSTED_DAEMON", refused
        assert f"it runs as uid {attacker.pw_uid} ({ATTACKER}), pid {d.proc.pid}" in refused["message"]
        accepted = hello(victim, PEERD_SOCKET=str(socket), PEERD_DAEMON_USER=ATTACKER)
        assert accepted["ok"] and accepted["reply"]["pid"] == d.proc.pid, accepted
    finally:
        for path in disguised:  # its own again, so that it can remove its socket
            os.chown(path, attacker.pw_uid, attacker.pw_gid, follow_symlinks=False)
        assert d.stop() == 0, d.logs()


def test_a_symlinked_socket_directory_is_refused_by_daemon_and_client_and_its_target_untouched(reachable_dir):
    target = reachable_dir / "target"
    target.mkdir(mode=0o700)
    (reachable_dir / "link").symlink_to(target)
    refused = serve("--socket", str(reachable_dir / "link" / "peerd.sock"), "--socket-dir-mode", "0750")
    assert refused.returncode != 0 and f"{reachable_dir}/link is a symlink" in refused.stderr, refused.stderr
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o700 and os.listdir(target) == [], "the target is untouched"

    d = Daemon(str(reachable_dir / "run" / "peerd.sock"), reachable_dir / "daemon.log").start()
    try:
        (reachable_dir / "alias").symlink_to(reachable_dir / "run")
        result = hello(PEERD_SOCKET=str(reachable_dir / "alias" / "peerd.sock"))
        assert result["type"] == "DaemonUnavailable" and result["code"] == "UNTRUSTED_DAEMON", result
        assert f"{reachable_dir}/alias is a symlink (to {reachable_dir}/run)" in result["message"]
    finally:
        assert d.stop() == 0


def test_a_socket_directory_under_a_parent_another_user_owns_is_refused_by_both(users, reachable_dir):
    attacker = users[ATTACKER]
    theirs = reachable_dir / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, attacker.pw_uid, attacker.pw_gid)
    refused = serve("--socket", str(theirs / "run" / "peerd.sock"))
    assert refused.returncode != 0 and f"{theirs} is owned by uid {attacker.pw_uid} ({ATTACKER})" in refused.stderr
    assert os.listdir(theirs) == [], "nothing created under another user's directory"

    parent = reachable_dir / "parent"
    parent.mkdir(mode=0o755)
    d = Daemon(str(parent / "run" / "peerd.sock"), reachable_dir / "daemon.log").start()
    try:
        os.chown(parent, attacker.pw_uid, attacker.pw_gid)  # she could now rename run/ and put hers there
        result = hello(PEERD_SOCKET=d.socket)
        assert result["code"] == "UNTRUSTED_DAEMON", result
        assert f"{parent} is owned by uid {attacker.pw_uid} ({ATTACKER})" in result["message"]
    finally:
        os.chown(parent, 0, 0)
        assert d.stop() == 0


@pytest.mark.parametrize("at", ["socket", "fd channel"])
@pytest.mark.parametrize("planted", ["file", "directory", "symlink"])
def test_serve_leaves_anything_but_a_stale_socket_at_its_path_untouched(reachable_dir, planted, at):
    """At its socket's path, or its fd channel's beside it (SOCKET.fd, which it unlinked whatever it was)."""
    sock = reachable_dir / "run" / "peerd.sock"
    path = sock if at == "socket" else Path(f"{sock}.fd")
    path.parent.mkdir(mode=0o700)
    kept = reachable_dir / "kept"
    kept.write_text("precious")
    if planted == "file":
        path.write_text("precious")
    elif planted == "directory":
        path.mkdir()
        (path / "inside").write_text("precious")
    else:
        path.symlink_to(kept)
    refused = serve("--socket", str(sock))
    words = {"file": "a regular file", "directory": "a directory", "symlink": "a symlink"}[planted]
    assert refused.returncode != 0 and f"{path} is {words}, not a socket" in refused.stderr, refused.stderr
    assert "leaves it as it is" in refused.stderr
    if planted == "file":
        assert path.read_text() == "precious"
    elif planted == "directory":
        assert (path / "inside").read_text() == "precious"
    else:
        assert path.is_symlink() and kept.read_text() == "precious"
    assert not os.path.exists(f"{sock}.lock"), "the lock is given back"


def test_a_lock_file_planted_as_a_symlink_is_refused_and_its_target_kept(reachable_dir):
    (reachable_dir / "run").mkdir(mode=0o700)
    victim = reachable_dir / "victim"
    victim.write_text("precious")
    (reachable_dir / "run" / "peerd.sock.lock").symlink_to(victim)
    refused = serve("--socket", str(reachable_dir / "run" / "peerd.sock"))
    assert refused.returncode != 0 and "peerd.sock.lock is a symlink" in refused.stderr, refused.stderr
    assert victim.read_text() == "precious", "never truncated through the link"


def test_an_existing_socket_directory_is_taken_as_it_is_with_a_warning(users, reachable_dir):
    existing = reachable_dir / "run"
    existing.mkdir(mode=0o700)
    d = Daemon(str(existing / "peerd.sock"), reachable_dir / "daemon.log", args=("--socket-group", GROUP)).start()
    try:
        info = os.stat(existing)
        assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_gid == 0, "peerd changes no directory it did not make"
        assert f"keeps the members of the socket group {GROUP} out" in d.logs()
        assert os.stat(d.socket).st_gid == grp.getgrnam(GROUP).gr_gid, "its own socket gets the group"
    finally:
        assert d.stop() == 0


@pytest.mark.parametrize("planted", ["file", "directory"])
def test_peerd_socket_at_a_file_or_directory_says_not_a_socket(reachable_dir, planted):
    path = reachable_dir / "not-a-socket"
    path.write_text("") if planted == "file" else path.mkdir()
    result = hello(PEERD_SOCKET=str(path))
    assert result["type"] == "DaemonUnavailable" and result["code"] == "NOT_A_SOCKET", result
    assert f"{path} is not a socket but a {'regular file' if planted == 'file' else 'directory'}" in result["message"]


@pytest.mark.parametrize("dir_mode, words", [("0750", "may not enter"), ("0755", "may not connect to")])
def test_a_socket_this_user_may_not_reach_says_permission_denied_and_names_the_group(users, reachable_dir,
                                                                                    dir_mode, words):
    d = Daemon(str(reachable_dir / "run" / "peerd.sock"), reachable_dir / "daemon.log",
               args=("--socket-group", GROUP, "--socket-dir-mode", dir_mode)).start()
    try:
        result = hello(users[VICTIM], PEERD_SOCKET=d.socket)
        assert result["type"] == "DaemonUnavailable" and result["code"] == "PERMISSION_DENIED", result
        assert f"permission denied: uid {users[VICTIM].pw_uid} ({VICTIM}) {words}" in result["message"], result
        assert f"members of group {GROUP} may" in result["message"]
    finally:
        assert d.stop() == 0


IMPOSTOR = """
import os, sys, time, zmq
from peerd.protocol import encode_packed_reply, pack_body
os.setgid(int(sys.argv[3]))
os.setuid(int(sys.argv[2]))  # imported first: this user may not read the test's interpreter
sock = zmq.Context().socket(zmq.DEALER)
while True:  # the moment the daemon's socket is gone
    try:
        sock.bind("ipc://" + sys.argv[1])
        break
    except zmq.ZMQError:
        time.sleep(0.01)
time.sleep(0.5)  # the worker's socket reconnects by itself meanwhile
for request_id in range(1, 20):
    sock.send(encode_packed_reply(request_id, pack_body({"ok": True, "reason": ""})))
time.sleep(5)
"""


def test_a_reply_from_another_process_bound_at_the_daemons_path_is_never_taken_for_its_answer(users,
                                                                                              reachable_dir):
    """ZeroMQ reconnects by itself. Where a daemon's socket sits in a directory others may bind in (a
    sticky one, like /tmp), a user could bind its path once the daemon went away and answer a call that
    still waited, before the drop was noticed: only hello's sender was checked. Every reply's is now."""
    sticky = reachable_dir / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    path = str(sticky / "peerd.sock")
    context = zmq.Context()
    daemon = context.socket(zmq.ROUTER)  # a trusted daemon (root's) that answers hello, then goes away
    daemon.bind("ipc://" + path)
    hello_body = {"instance": 1, "version": "0", "protocol": protocol.VERSION, "pid": os.getpid(),
                  "backend": "host", "rendezvous_timeout": 60.0, "agreement_timeout": 60.0}

    def serve_hello_then_go() -> None:
        identity, frame = daemon.recv_multipart()
        daemon.send_multipart([identity, protocol.encode_packed_reply(protocol.decode_envelope(frame)[0],
                                                                      protocol.pack_body(hello_body))])
        daemon.recv_multipart()  # the vote below: never answered
        daemon.close(linger=0)
        os.unlink(path)

    server = threading.Thread(target=serve_hello_then_go)
    server.start()
    attacker = users[ATTACKER]
    impostor = subprocess.Popen([sys.executable, "-c", IMPOSTOR, path, str(attacker.pw_uid), str(attacker.pw_gid)])
    try:
        conn = Connection(path)
        with pytest.raises(DaemonUnavailable, match="went away"):
            conn.call("agree", {"group": "g", "rank": 0, "npes": 2, "ok": False, "timeout": 30}, timeout=20,
                      meanwhile=lambda: time.sleep(1.5))  # busy while the daemon goes and the impostor binds
    finally:
        server.join(10)
        impostor.kill()
        impostor.wait()
        context.term()


IMPOSTOR = """
import os, socket, sys
path, uid, gid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.unlink(path)  # the daemon's fd channel, replaced by one whose listen() is another user's
sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
sock.bind(path)
os.chmod(path, 0o666)
os.setgid(gid)
os.setuid(uid)
sock.listen(16)
print("READY", flush=True)
held = []
while True:
    held.append(sock.accept()[0])
"""


@pytest.mark.skipif(not (shutil.which("unshare") and shutil.which("nsenter")), reason="needs util-linux's "
                    "unshare and nsenter")
def test_an_fd_channel_served_by_another_user_is_refused_by_a_worker_that_sees_no_pids(socket_dir, users):
    """A worker in a pod sees pid 0 for any server outside its pid namespace, so comparing the fd
    channel's server with the daemon by pid passed whoever served SOCKET.fd: another user's server
    there was taken for the daemon's. Its uid is compared now, as the daemon socket's is."""
    attacker = users[ATTACKER]
    d = Daemon(os.path.join(socket_dir, "peerd.sock"), Path(socket_dir) / "daemon.log").start()
    impostor = subprocess.Popen([sys.executable, "-c", IMPOSTOR, d.socket + ".fd", str(attacker.pw_uid),
                                 str(attacker.pw_gid)], stdout=subprocess.PIPE, text=True)
    pod = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", "sleep", "600"])
    try:
        assert impostor.stdout.readline().strip() == "READY"
        init = child_of(pod.pid)  # the ranks join its pid and mount (its /proc) namespaces
        ranks = [subprocess.Popen(
            ["nsenter", "--target", str(init), "--pid", "--mount", "--", sys.executable, str(HERE / "rank.py"),
             "join", "--rank", str(r), "--npes", "2", "--group", "fd-impostor", "--hold", "0", "--timeout", "20"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=d.env()) for r in range(2)]
        for rank in ranks:
            out, err = rank.communicate(timeout=60)
            result = json.loads(out.strip().splitlines()[-1])
            assert not result["ok"] and f"is served by uid {attacker.pw_uid} ({ATTACKER})" in result["message"], \
                (result, err)
            assert "not by the daemon's user (uid 0 (root))" in result["message"], result
    finally:
        for proc in (impostor, pod):
            proc.kill()
            proc.wait()
        assert d.stop() == 0, d.logs()
