"""The metrics port under a flood by a local user who cannot even reach the daemon's socket.

prometheus_client's own server gave each connection a thread and an fd, with
no cap and no timeout: 4083 idle TCP connections to 127.0.0.1:PORT took the
daemon past LimitNOFILE and libzmq aborted it at its next connection. Here a
real extra user (outside the socket's group) holds 300 idle connections,
reopening each one the daemon drops, while the daemon's fds are counted from
/proc; the daemon must keep them bounded, keep answering its own user, drop
idle and trickling connections within its timeouts, and serve a scrape once
the flood ends.
"""

from __future__ import annotations

import json
import os
import pwd
import select
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from peerd_client.connection import Connection

from peerd.metricsport import DEADLINE_S, IDLE_TIMEOUT_S, MAX_CONNECTIONS, peer_uid
from tests.conftest import Daemon, local_users, wait_until

FLOODER, FLOODER_GROUP = "pdm-flood", "pdm-none"  # the group is the user's own: not the daemon's socket group
CONNECTIONS = 300
FLOOD_S = 6.0  # longer than IDLE_TIMEOUT_S + SLACK_S: a connection the daemon never drops shows
SLACK_S = 1.5

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create users (CI runs as root)")

#: run as root, then as UID:GID (everything imported first): holds COUNT idle connections to 127.0.0.1:PORT
#: for SECONDS, opening a new one for each the daemon drops; prints READY, then one JSON line of what it saw
FLOOD = r"""
import errno, json, os, selectors, socket, sys, time
uid, gid, port, count, seconds, unix_path = sys.argv[1:]
port, count, seconds = int(port), int(count), float(seconds)
os.setgroups([]); os.setgid(int(gid)); os.setuid(int(uid))
try:
    socket.socket(socket.AF_UNIX).connect(unix_path)
    daemon_socket = "connected"
except OSError as e:
    daemon_socket = errno.errorcode.get(e.errno, str(e.errno))
sel = selectors.DefaultSelector()
since = {}  # socket -> when its connection was made (None while connecting)
seen = dict(attempts=0, connected=0, reset=0, dropped=0, longest_held=0.0)
def open_one():
    s = socket.socket()
    s.setblocking(False)
    seen["attempts"] += 1
    if s.connect_ex(("127.0.0.1", port)) not in (0, errno.EINPROGRESS):
        s.close()
        seen["reset"] += 1
        return
    since[s] = None
    sel.register(s, selectors.EVENT_WRITE)
def forget(s):
    sel.unregister(s)
    del since[s]
    s.close()
for _ in range(count):
    open_one()
print("READY " + json.dumps({"daemon_socket": daemon_socket}), flush=True)
end = time.monotonic() + seconds
while time.monotonic() < end:
    for key, _ in sel.select(0.05):
        s, now = key.fileobj, time.monotonic()
        if since[s] is None:
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                seen["reset"] += 1
                forget(s); open_one()
                continue
            since[s] = now
            seen["connected"] += 1
            sel.modify(s, selectors.EVENT_READ)
            continue
        try:
            data = s.recv(1)
        except OSError:
            data = b""
        if data:
            continue
        seen["dropped"] += 1
        seen["longest_held"] = max(seen["longest_held"], now - since[s])
        forget(s); open_one()
print(json.dumps(seen), flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def scrapes(port: int) -> bool:
    try:
        return "peerd_ranks_held" in scrape(port)
    except OSError:
        return False


def closed_after(conn: socket.socket, trickle: bytes = b"", every: float = 0.5, limit: float = 15) -> float:
    """Seconds until the server closes conn, sending trickle a byte at a time meanwhile."""
    started = time.monotonic()
    conn.setblocking(False)
    while time.monotonic() - started < limit:
        if select.select([conn], [], [], every)[0]:
            try:
                if not conn.recv(4096):
                    return time.monotonic() - started
            except OSError:
                return time.monotonic() - started
        if trickle:
            try:
                conn.send(trickle[:1])
            except OSError:
                return time.monotonic() - started
            trickle = trickle[1:] or b"X"
    return float("inf")


def kernel_names_socket_owners() -> bool:
    """Whether sock_diag tells this process who owns a local TCP socket (where it cannot, every
    connection to the metrics port shares one uid's share, and no per-uid share can hold)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        with socket.create_connection(server.getsockname()) as client:
            accepted, address = server.accept()
            with accepted:
                return peer_uid(server.getsockname(), address) == os.geteuid()


@pytest.fixture
def flooder_user():
    with local_users(FLOODER_GROUP, FLOODER):
        yield pwd.getpwnam(FLOODER)


def test_a_flood_of_idle_connections_to_the_metrics_port_leaves_the_daemon_bounded_and_serving(
        socket_dir, flooder_user):
    port = free_port()
    d = Daemon(os.path.join(socket_dir, "run", "peerd.sock"), Path(socket_dir) / "daemon.log",
               args=("--metrics-port", str(port)))
    d.start()
    flood = None
    try:
        assert scrapes(port)
        baseline = fd_count(d.proc.pid)

        most, sampling = [baseline], threading.Event()

        def sample() -> None:
            while not sampling.wait(0.02):
                try:
                    most[0] = max(most[0], fd_count(d.proc.pid))
                except OSError:  # gone: the assertions below say so
                    return

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        flood = subprocess.Popen(
            [sys.executable, "-c", FLOOD, str(flooder_user.pw_uid), str(flooder_user.pw_gid), str(port),
             str(CONNECTIONS), str(FLOOD_S), d.socket],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ready = flood.stdout.readline()
        assert ready.startswith("READY "), (ready, flood.stderr.read() if flood.poll() is not None else "")
        assert json.loads(ready[len("READY "):])["daemon_socket"] in ("EACCES", "EPERM"), ready

        # while the flood is on: the daemon lives and answers its own user
        conn = Connection(d.socket)
        conn.call("hello", {})
        conn.close()
        status = d.cli("status", "--json")
        assert status.returncode in (0, 1), status.stderr
        assert d.proc.poll() is None, d.logs()[-3000:]
        # and another uid's scrape is served: the flooder holds only its own share of the slots (a connect
        # may wait for room in the kernel's accept queue, which the flood keeps full, so more than one try)
        if kernel_names_socket_owners():
            while flood.poll() is None and not scrapes(port):
                pass
            assert flood.poll() is None, "no scrape was served while the flood was on"

        out, err = flood.communicate(timeout=FLOOD_S + 30)
        sampling.set()
        sampler.join()
        assert flood.returncode == 0, err
        seen = json.loads(out.splitlines()[-1])
        assert d.proc.poll() is None, f"the daemon died:\n{d.logs()[-3000:]}"

        # the daemon's fds stayed bounded: the slots, a connection being reset, the hello and status above
        assert most[0] <= baseline + MAX_CONNECTIONS + 6, (most[0], baseline, seen)
        # the flooder did try: far more connections were made than the daemon keeps
        assert seen["connected"] + seen["reset"] >= CONNECTIONS, seen
        assert seen["dropped"] + seen["reset"] >= CONNECTIONS - MAX_CONNECTIONS, seen
        # and none that the daemon took stayed idle past the timeout (a connection the kernel finished but
        # could not queue for the daemon's accept, the backlog being full, costs the daemon no fd: the fd
        # count above is what bounds those)
        assert seen["longest_held"] <= IDLE_TIMEOUT_S + SLACK_S, seen
        assert "connection(s) refused so far" in d.logs()

        # the flood is over: scrapes work, the fds come back
        wait_until(lambda: scrapes(port), IDLE_TIMEOUT_S + SLACK_S, "a scrape to be served")
        wait_until(lambda: fd_count(d.proc.pid) <= baseline + 1, 5, "the daemon's fds to come back")

        # an idle connection is dropped at the idle timeout; one trickling a request at its deadline;
        # meanwhile a scrape is served beside them
        with socket.create_connection(("127.0.0.1", port)) as idle, \
                socket.create_connection(("127.0.0.1", port)) as trickling:
            waits: dict[str, float] = {}
            threads = [threading.Thread(target=lambda: waits.__setitem__("idle", closed_after(idle))),
                       threading.Thread(target=lambda: waits.__setitem__(
                           "trickling", closed_after(trickling, b"GET /metrics HTTP/1.1\r\nX-Slow: ", every=0.4)))]
            for t in threads:
                t.start()
            assert scrapes(port)
            for t in threads:
                t.join()
        assert IDLE_TIMEOUT_S - 0.5 <= waits["idle"] <= IDLE_TIMEOUT_S + SLACK_S, waits
        assert DEADLINE_S - 0.5 <= waits["trickling"] <= DEADLINE_S + SLACK_S, waits
        assert d.proc.poll() is None
    finally:
        if flood is not None and flood.poll() is None:
            flood.kill()
            flood.wait(timeout=10)
        code = d.stop()
    assert code == 0, d.logs()[-3000:]
