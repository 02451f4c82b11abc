"""The connection guard: caps the connections the daemon holds, in total and per uid.

libzmq has no such cap, and it aborts the whole process when accept() hits
the fd limit (its ipc listener asserts on EMFILE), so a local user opening
idle connections could kill the daemon. The guard watches the ROUTER's
monitor, which reports each accepted connection's fd: it reads the peer's
uid off a dup of that fd (SO_PEERCRED) and, past a cap, shuts the connection
down (shutdown(2): libzmq's engine reads EOF and closes its own fd; the
guard never closes an fd it does not own). It runs on a thread of its own,
so a busy loop never delays it, and libzmq blocks its I/O thread while the
monitor's queue is full, so accepting never runs far ahead of the guard.
The budget leaves room for that lag: see ``default_max_connections``.
The last few connections of the total cap (``ADMIN_CONNECTIONS``) are kept
for root and the daemon's own uid: other uids filling the cap must not
blind `peerd status`, whose failure a liveness probe answers by restarting
the daemon, which fails every group it serves.

A connection whose opener exited is shut down too, within ``SWEEP_S``: a
worker that forked (a data loader) and exited leaves its socket to the
child, which never speaks on it (peerd_client opens a connection of its own
in a forked child; the daemon would name the dead opener as the caller of
anything sent on it), yet it counted against the user's cap, until that
user could not connect at all. The guard knows the opener by a pidfd, which
turns readable when that process exits, though its parent never reaps it (a
zombie keeps its pid) or its pid is another process's by then.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import select
import socket
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterator

import zmq

from .access import GroupSource, peer_groups
from .tally import Tally
from .trust import peer_credentials, peer_pidfd, pid_alive

log = logging.getLogger("peerd.connections")

#: fds the daemon keeps for itself: listener, zmq's mailboxes and epoll, the
#: wakeup pipe, metrics, logs, and the transient dup the guard makes
FDS_RESERVED = 128
#: connections libzmq may accept before the guard sees them: its I/O thread
#: blocks once the monitor's queue (1000 events, plus the guard's receive
#: high-water mark of 1) is full
MONITOR_LAG = 1024
#: fds one connection may bring: its socket, the guard's pidfd on its opener, the loop's pidfd on
#: its process (peerd.liveness), a buffer's fd
FDS_PER_CONNECTION = 4
#: the default cap never exceeds this: past it, idle connections alone would
#: cost the daemon more memory than its whole working set
MAX_CONNECTIONS_CEILING = 4096
#: the default cap never goes below this, even where the fd limit is too low to
#: carry it (the daemon then warns at start)
MIN_DEFAULT_CONNECTIONS = 256
#: the default per-uid cap: a worker process holds one connection, so this is
#: 8 GPUs times 8 processes of one user; it also bounds what one uid can make
#: the daemon queue (about 1.3 MiB a connection: see peerd.server's high-water marks)
DEFAULT_CONNECTIONS_PER_UID = 64
#: a uid the allowlist refuses still gets a few connections, to receive its FORBIDDEN reply
REFUSED_UID_CONNECTIONS = 4
#: connections of --max-connections only root and the daemon's own uid may take, so that once other uids
#: (one tenant may have many) hold the rest, `peerd status` (the liveness probe) still answers them; kept
#: inside the cap, so the fd budget, which counts --max-connections, holds them already
ADMIN_CONNECTIONS = 4
#: seconds between two looks for connections whose opener exited
SWEEP_S = 1.0



def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard one (always allowed); the limit now in force."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def connections_within(fd_limit: int) -> int:
    """How many connections an fd limit carries, after the daemon's own fds and the guard's lag."""
    return max(0, (fd_limit - FDS_RESERVED - MONITOR_LAG) // FDS_PER_CONNECTION)


def default_max_connections() -> int:
    """What the hard fd limit carries (the daemon raises its soft limit to it), between the floor and the ceiling."""
    carried = connections_within(resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    return max(MIN_DEFAULT_CONNECTIONS, min(MAX_CONNECTIONS_CEILING, carried))


@dataclass(frozen=True)
class ConnectionLimits:
    total: int  # --max-connections
    per_uid: int  # --max-connections-per-uid

    @property
    def reserved(self) -> int:
        """The connections of ``total`` kept for the admins; at most half of it, so others still get a share."""
        return min(ADMIN_CONNECTIONS, self.total // 2)

    def unsafe_under(self, fd_limit: int) -> str | None:
        """Why the fd limit cannot carry these caps through a flood of connections, or None."""
        if self.total <= connections_within(fd_limit):
            return None
        needed = self.total * FDS_PER_CONNECTION + FDS_RESERVED + MONITOR_LAG
        return (f"--max-connections {self.total} needs about {needed} file descriptors, the limit is {fd_limit}: "
                "a flood of connections could exhaust them, and libzmq aborts the daemon then; raise the hard "
                f"limit (LimitNOFILE= in the unit, ulimit -Hn) or lower --max-connections to "
                f"{connections_within(fd_limit)}")


@dataclass(frozen=True)
class Opener:
    """The process that made a connection: its pid (SO_PEERCRED) and a pidfd on it, or None where the
    kernel gives none (the guard then looks its pid up)."""
    pid: int
    pidfd: int | None


class ConnectionGuard:
    """Admits or shuts down each connection the ROUTER accepts; the loop only reads its counters."""

    def __init__(self, router: zmq.Socket, limits: ConnectionLimits, admins: frozenset[int],
                 allows: Callable[[int, int, GroupSource], bool]):
        self.limits = limits  # replaced on SIGHUP
        self._admins = admins  # root and the daemon's own uid: they may take the reserved connections
        self._allows = allows  # the daemon's current allowlist: (uid, gid, supplementary groups) -> bool
        address = f"inproc://peerd-connections-{id(self)}"
        router.monitor(address, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._monitor = router.context.socket(zmq.PAIR)
        self._monitor.setsockopt(zmq.RCVHWM, 1)  # keeps libzmq's lead at the monitor's own queue (MONITOR_LAG)
        self._monitor.connect(address)
        self._lock = threading.Lock()
        self._uid_of: dict[int, int] = {}  # fd -> uid, for each connection let in
        self._opener: dict[int, Opener] = {}  # fd -> the process that connected; the guard's thread only
        self._next_sweep = 0.0
        self._address = ""  # the ROUTER's endpoint, as the monitor names it
        self._by_uid: Counter[int] = Counter()
        self._refused = Tally(log, "shut down %d connection(s)")
        self._thread = threading.Thread(target=self._run, name="peerd-connection-guard", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self) -> None:
        """Wait for the thread, which ends once the daemon's ZeroMQ context is terminated."""
        self._thread.join(timeout=5)

    def snapshot(self) -> dict:
        """The counters `peerd status` shows."""
        with self._lock:
            return {
                "open": len(self._uid_of),
                "max": self.limits.total,
                "max_per_uid": self.limits.per_uid,
                "refused": self._refused.total,
                "top_uids": [[uid, n] for uid, n in self._by_uid.most_common(5)],
            }

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        while True:
            try:
                self._step()
            except zmq.ContextTerminated:  # the daemon is shutting down
                self._monitor.close(linger=0)
                for fd in list(self._opener):
                    self._forget(fd)
                return
            except Exception:  # a bug must cost one connection's check, never the cap (nor libzmq's I/O thread,
                log.exception("the connection guard hit an error; guarding on")  # which waits on this queue)

    def _step(self) -> None:
        if self._monitor.poll(int(SWEEP_S * 1000)):
            head, address = self._monitor.recv_multipart()
            event, value = struct.unpack("=HI", head[:6])
            self._address = address.decode()
            if event == zmq.EVENT_ACCEPTED:
                self._admit(value, self._address)
            else:
                self._forget(value)
        now = time.monotonic()
        if now >= self._next_sweep:
            self._next_sweep = now + SWEEP_S
            self._sweep()
        self._refused.flush()

    def _sweep(self) -> None:
        """Shut down each connection whose opener exited (a forked child may hold it on)."""
        for fd in self._openers_exited():
            with _peer_at(fd, self._address) as peer:
                if peer is not None and peer_credentials(peer).pid == self._opener[fd].pid:  # not a new connection
                    peer.shutdown(socket.SHUT_RDWR)  # its EVENT_DISCONNECTED forgets it
                    self._refused.add("their opener exited (a process it forked held them on)")

    def _openers_exited(self) -> list[int]:
        """The connections whose opener exited: its pidfd is readable (one poll for all of them); without
        one, its pid is gone (pid 0: an opener in another pid namespace, never known dead then)."""
        poller, of_pidfd, exited = select.poll(), {}, []
        for fd, opener in self._opener.items():
            if opener.pidfd is not None:
                poller.register(opener.pidfd, select.POLLIN)
                of_pidfd[opener.pidfd] = fd
            elif opener.pid > 0 and not pid_alive(opener.pid):
                exited.append(fd)
        return exited + [of_pidfd[pidfd] for pidfd, _ in poller.poll(0)]

    def _admit(self, fd: int, address: str) -> None:
        with _peer_at(fd, address) as peer:
            if peer is None:
                return
            who = peer_credentials(peer)
            why = self._over_cap(who.uid, who.gid, lambda: peer_groups(peer))
            if why is None:
                with self._lock:
                    self._uid_of[fd] = who.uid
                    self._by_uid[who.uid] += 1
                self._opener[fd] = Opener(who.pid, peer_pidfd(peer, who.pid))
                return
            peer.shutdown(socket.SHUT_RDWR)  # libzmq sees EOF and closes its fd itself
        self._refused.add(why)

    def _over_cap(self, uid: int, gid: int, groups: GroupSource) -> str | None:
        """Why this connection may not stay, or None; ``groups``: its supplementary groups, read off it."""
        limits = self.limits
        if len(self._uid_of) >= limits.total:
            return f"the daemon holds {limits.total} connections (--max-connections)"
        if uid not in self._admins and len(self._uid_of) >= limits.total - limits.reserved:
            return (f"the daemon holds {limits.total - limits.reserved} connections: the rest of --max-connections "
                    f"({limits.total}) is kept for root and its own user")
        if not self._allows(uid, gid, groups):
            if self._by_uid[uid] >= REFUSED_UID_CONNECTIONS:
                return f"uid {uid} is not in the allowlist and holds the {REFUSED_UID_CONNECTIONS} connections left to it"
        elif self._by_uid[uid] >= limits.per_uid:
            return f"uid {uid} holds {limits.per_uid} connections (--max-connections-per-uid)"
        return None

    def _forget(self, fd: int) -> None:
        opener = self._opener.pop(fd, None)
        if opener is not None and opener.pidfd is not None:
            os.close(opener.pidfd)
        with self._lock:
            uid = self._uid_of.pop(fd, None)
            if uid is not None:
                self._by_uid[uid] -= 1
                if not self._by_uid[uid]:
                    del self._by_uid[uid]


@contextlib.contextmanager
def _peer_at(fd: int, address: str) -> Iterator[socket.socket | None]:
    """A dup of libzmq's connection fd as a socket, closed after; None where the number is closed
    already (its EVENT_DISCONNECTED follows) or reused for anything but a connection to ``address``:
    the guard never touches an fd it does not own."""
    try:
        dup = os.dup(fd)
    except OSError:
        yield None
        return
    try:
        peer = socket.socket(fileno=dup)
    except OSError:  # the number was reused for something else than a socket
        os.close(dup)
        yield None
        return
    with peer:
        ours = peer.family == socket.AF_UNIX and f"ipc://{peer.getsockname()}" == address
        yield peer if ours else None
