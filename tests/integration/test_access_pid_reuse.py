"""A caller is who the kernel said it was at connect, never what /proc/PID says later.

The attack (a reviewer's, reproduced): with ``--allow-gid A``, eve (socket group, not in A) connects
from pid P, forks a keeper that inherits the connection, and exits; once P is a process of bob (a
member of A), the keeper's messages must still be eve's. The pid wrap is forced, as root, through
/proc/sys/kernel/ns_last_pid. Real daemon, real users, real pid reuse; both routes: the daemon's
ZeroMQ socket and its fd channel.
"""

from __future__ import annotations

import json
import os
import pwd
import select
import signal
import socket
import struct
import subprocess
import traceback
from pathlib import Path

import msgpack
import pytest

from peerd.connections import REFUSED_UID_CONNECTIONS
from peerd.fdchannel import connect as fd_connect
from peerd.fdchannel import fetch_fds
from peerd.paths import fd_socket_path
from peerd.protocol import decode_reply, encode_request
from peerd.routingids import new_routing_id
from tests.conftest import Daemon, local_users

EVE, BOB, SOCKET_GROUP, ALLOWED = "pdc-reve", "pdc-rbob", "pdc-rsock", "pdc-rallow"
NS_LAST_PID = "/proc/sys/kernel/ns_last_pid"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.access(NS_LAST_PID, os.W_OK),
    reason="needs root: creates users and forces a pid's reuse through ns_last_pid",
)


@pytest.fixture(scope="module")
def users():
    """eve and bob, both of the socket group; bob also of ALLOWED, as a supplementary group."""
    with local_users(SOCKET_GROUP, EVE, BOB):
        made = subprocess.run(["groupadd", ALLOWED], capture_output=True, check=False).returncode == 0
        try:
            subprocess.run(["usermod", "-aG", ALLOWED, BOB], check=True)
            yield pwd.getpwnam(EVE), pwd.getpwnam(BOB)
        finally:
            if made:
                subprocess.run(["groupdel", ALLOWED], check=False)


def daemon_with(socket_dir: str, *args: str) -> Daemon:
    """A root daemon on a socket in a directory it creates, which other users can reach."""
    os.chmod(socket_dir, 0o755)
    return Daemon(os.path.join(socket_dir, "run", "peerd.sock"), Path(socket_dir) / "daemon.log", args=args).start()


# ------------------------------------------------------------ a bare ZeroMQ DEALER: fork-safe, no libzmq

def _exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError("the daemon closed the connection")
        data += chunk
    return data


def zmtp_connect(path: str) -> socket.socket:
    """A ZMTP 3.0 NULL-mechanism DEALER over a plain unix socket (its fd passes to a child like any), named
    with a routing id of its own."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(path)
    sock.sendall(b"\xff" + b"\x00" * 8 + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\x00") + b"\x00" * 32)
    _exactly(sock, 64)
    name = new_routing_id()  # the daemon answers only a connection that named itself so (peerd.routingids)
    ready = (b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
             + b"\x08Identity" + struct.pack(">I", len(name)) + name)
    sock.sendall(bytes([0x04, len(ready)]) + ready)
    _frame(sock)
    return sock


def _frame(sock: socket.socket) -> tuple[int, bytes]:
    flags = _exactly(sock, 1)[0]
    size = _exactly(sock, 8 if flags & 2 else 1)
    return flags, _exactly(sock, struct.unpack(">Q", size)[0] if flags & 2 else size[0])


def zmtp_call(sock: socket.socket, request_id: int, op: str, body: dict):
    """The reply's body, or [code, message]."""
    payload = encode_request(request_id, op, body)
    sock.sendall((bytes([0x00, len(payload)]) if len(payload) < 256 else b"\x02" + struct.pack(">Q", len(payload)))
                 + payload)
    while True:
        flags, data = _frame(sock)
        if not flags & 4:  # not a command (PING)
            reply = decode_reply(data)
            return reply.body if reply.ok else [reply.error.code.value, reply.error.message]


def code(reply) -> str:
    """A reply's error code, or what it answered."""
    return reply[0] if isinstance(reply, list) else f"answered {sorted(reply)}"


def join(group: str) -> dict:
    return {"group": group, "name": "b", "rank": 0, "npes": 1, "nbytes": 4096, "device": "host", "flags": 0,
            "timeout": None}


def fd_request(sock: socket.socket, group: str) -> dict:
    """One fd channel request on a connection already made: the reply, fds counted and closed."""
    sock.send(msgpack.packb({"group": group, "name": "b", "rank": 0}, use_bin_type=True))
    data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 16)
    for fd in fds:
        os.close(fd)
    return {**msgpack.unpackb(data, raw=False), "fds": len(fds)}


# ------------------------------------------------------------ processes

def become(user: pwd.struct_passwd) -> None:
    os.initgroups(user.pw_name, user.pw_gid)
    os.setgid(user.pw_gid)
    os.setuid(user.pw_uid)


def child(work, out: int) -> None:
    """Run work() in this forked child, write what it returns (or its traceback) to out, and exit."""
    try:
        said = work()
    except BaseException:
        said = {"error": traceback.format_exc()}
    try:
        os.write(out, json.dumps(said, default=repr).encode() + b"\n")  # handles are bytes
    finally:
        os._exit(0)


def heard(fd: int, timeout: float = 15) -> dict:
    data = b""
    while not data.endswith(b"\n"):
        assert select.select([fd], [], [], timeout)[0], "a child process said nothing"
        chunk = os.read(fd, 65536)
        assert chunk, "a child process died before it answered"
        data += chunk
    said = json.loads(data)
    assert "error" not in said, said["error"]
    return said


def fork_at(pid: int) -> int:
    """fork() as the process that gets ``pid``: 0 in the child, ``pid`` in the parent."""
    for _ in range(50):
        with open(NS_LAST_PID, "w") as last:
            last.write(str(pid - 1))
        got = os.fork()
        if got == 0:
            if os.getpid() != pid:
                os._exit(0)
            return 0
        if got == pid:
            return pid
        os.waitpid(got, 0)  # another process took it first: again
    raise AssertionError(f"could not make pid {pid} be reused")


def test_a_connection_kept_past_its_pid_is_still_its_makers_when_an_allowed_user_takes_the_pid(socket_dir, users):
    eve, bob = users
    d = daemon_with(socket_dir, "--socket-group", SOCKET_GROUP, "--allow-gid", ALLOWED)
    fd_path = fd_socket_path(d.socket)
    eve_r, eve_w = os.pipe()
    go_r, go_w = os.pipe()
    bob_r, bob_w = os.pipe()
    done_r, done_w = os.pipe()
    keeper = bob_pid = None
    try:
        pid = os.fork()
        if pid == 0:  # eve, at pid P: both connections made, then handed to a keeper
            def eve_at_p():
                become(eve)
                zmq_conn, fd_conn = zmtp_connect(d.socket), fd_connect(fd_path, 10)
                hello = zmtp_call(zmq_conn, 1, "hello", {})
                keeper = os.fork()
                if keeper == 0:
                    def keeper_of_p():
                        os.read(go_r, 1)  # once P is bob's
                        return {"join": zmtp_call(zmq_conn, 2, "join", join("eve-sneaks-in")),
                                "status": zmtp_call(zmq_conn, 3, "status", {}),
                                "fd": fd_request(fd_conn, "eve-sneaks-in")}
                    child(keeper_of_p, eve_w)
                return {"hello": hello, "keeper": keeper}
            child(eve_at_p, eve_w)
        at_p = heard(eve_r)
        keeper = at_p["keeper"]
        assert at_p["hello"][0] == "FORBIDDEN", "eve alone is refused"
        os.waitpid(pid, 0)  # P is free

        bob_pid = fork_at(pid)
        if bob_pid == 0:  # bob, at pid P: his own groups, his own connections
            def bob_at_p():
                become(bob)
                os.write(bob_w, b'{"ready": true}\n')
                conn = zmtp_connect(d.socket)
                joined = zmtp_call(conn, 1, "join", join("bob-own"))
                handles, fds = fetch_fds(fd_path, {"group": "bob-own", "name": "b", "rank": 0}, 10)
                for fd in set(fds):
                    os.close(fd)
                more, held = [], [conn]  # past the 4 connections the guard leaves a uid it refuses: bob is none
                for n in range(2, 2 + REFUSED_UID_CONNECTIONS + 2):
                    try:
                        held.append(zmtp_connect(d.socket))
                        more.append(code(zmtp_call(held[-1], n, "ls", {})))
                    except (OSError, EOFError) as err:
                        more.append(f"shut down: {err!r}")
                os.read(done_r, 1)
                return {"join": joined, "handles": len(handles), "fds": len(fds), "more": more}
            child(bob_at_p, bob_w)
        assert heard(bob_r) == {"ready": True}, "bob holds pid P, with his groups"
        assert os.stat(f"/proc/{pid}").st_uid == bob.pw_uid

        os.write(go_w, b"x")
        kept = heard(eve_r)
        got = {"join": code(kept["join"]), "status": code(kept["status"]),
               "fd": kept["fd"].get("code", f"{kept['fd']['fds']} fds")}
        assert got == {"join": "FORBIDDEN", "status": "FORBIDDEN", "fd": "FORBIDDEN"}, \
            f"eve's keeper got in on bob's pid: {kept}"
        assert kept["fd"]["fds"] == 0

        os.write(done_w, b"x")
        own = heard(bob_r)
        assert "handles" in own["join"] and own["handles"] == own["fds"] == 1, \
            f"bob, allowed only through a supplementary group, is admitted on both routes: {own}"
        assert own["more"] == ["answered ['groups', 'more']"] * (REFUSED_UID_CONNECTIONS + 2), own["more"]
        os.waitpid(bob_pid, 0)
        bob_pid = None
        logs = d.logs()
        assert f"refused pid {pid} (uid {eve.pw_uid}" in logs and "bob-own" in logs
        assert "SO_PEERGROUPS" not in logs, "this kernel reports the groups"
    finally:
        for stray in (keeper, bob_pid):
            if stray:
                try:
                    os.kill(stray, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if bob_pid:
            os.waitpid(bob_pid, 0)
        for fd in (eve_r, eve_w, go_r, go_w, bob_r, bob_w, done_r, done_w):
            os.close(fd)
        assert d.stop() == 0, d.logs()

