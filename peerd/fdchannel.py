"""The fd channel: members receive their set's host memory as file descriptors.

Why fds and not names: a name in /dev/shm is a door. Whoever file permissions
let through can open it (the whole socket group, when the daemon runs as its
own user), anyone can take a guessable name first and block every
allocation, and named memory outlives a daemon that crashed. A memfd has no
name: the daemon holds the only reference until it passes the fd, with
SCM_RIGHTS, to a process the kernel vouches for (SO_PEERCRED) that holds a
rank of the set; the kernel frees the memory once the last fd and mapping
are gone, whatever killed the daemon.

The channel is a SOCK_SEQPACKET socket at ``<socket path>.fd``, beside the
daemon's ZeroMQ socket and guarded like it. One request per connection,
``{group, name, rank}``; the answer is ``{ok: true, handles}`` with the set's
fds in rank order (at most FDS_PER_MESSAGE fds per message), or ``{ok: false,
code, message}``; then the daemon closes. Handles sharing one fd (ranks in one
arena chunk) send it once: ``fd_index`` then gives each handle's fd by its
place among those sent. Why once: a passed fd counts against the daemon's
user until the receiver reads it (the kernel refuses past its fd limit,
ETOOMANYREFS, unless it holds CAP_SYS_RESOURCE), and a client that never
reads its replies must not make every other user's fds stop there. ``{group, name, rank, page: true}``
asks instead for the area holding the set's control page and the daemon's
alive pipe (peerd.pages), on every backend. The daemon's half never blocks its
loop: it accepts, reads and sends without waiting, and drops a connection
that is slow, oversized or does not read.

Who asks is the kernel's word on the accepted socket itself: SO_PEERCRED for
the uid, gid and pid, SO_PEERGROUPS for the supplementary groups the
allowlist may need (read only if asked), both as recorded at connect. Nothing
is read from /proc/PID, which may be another process by the time the request
comes (a caller can hand its connection to a child and exit).

A reply's fds count against the daemon's user until the client reads them,
whatever becomes of the daemon's end, and past that user's fd limit the
kernel refuses every pass (ETOOMANYREFS) unless the daemon holds
CAP_SYS_RESOURCE: a client that asked over and over and never read would
stop every other user's setup. So an answered connection whose reply the
client has not read yet stays open until the socket's send queue is empty
(the client read the reply, or closed, which purges it: a shutdown() does
not), and a uid holding MAX_UNREAD_PER_UID such replies, each looked at
again just then, is refused more (LIMIT_EXCEEDED, with no fd): one uid holds
at most that many replies' fds in flight. The cap is well above what a
node's ranks of one user ask for at once (a chunk and an area each). Each
such connection also holds a place in the daemon's fd room (peerd.fdroom)
until it goes, and together they hold at most UNREAD_FD_SHARE of it; a
request finding that share, or the whole room, taken is refused: the users
of the socket group together cannot spend the fds the daemon's connections
need, however many of them there are.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import fcntl
import socket
import struct
import termios
import time
from typing import Any, Callable

import msgpack
import zmq

from .access import GroupSource, peer_groups, secure_socket
from .credentials import Credentials
from .fdroom import FdRoom
from .protocol import ErrorCode, ProtocolError
from .tally import Tally
from .trust import describe_uid, peer_credentials

log = logging.getLogger("peerd.fdchannel")

#: fds per message: the kernel passes at most SCM_MAX_FD (253) in one
FDS_PER_MESSAGE = 250
#: a request names one slot: anything larger is not one
MAX_REQUEST_BYTES = 4096
#: room for the reply naming 1024 handles
MAX_REPLY_BYTES = 1 << 16
#: open connections at most; past it the oldest of the uid holding the most is dropped
MAX_CONNECTIONS = 64
#: open connections of one uid at most; past it that uid's own oldest is dropped, never another's
MAX_CONNECTIONS_PER_UID = 16
#: answered connections of one uid whose replies (and fds) its clients have not read, at most
MAX_UNREAD_PER_UID = 64
#: the share of the daemon's fd room (peerd.fdroom) those may hold together, whatever else is in it: a
#: reply read at once holds its place for a moment, so only a room full to the last place refuses it
UNREAD_FD_SHARE = 0.25
#: how long a connection may take to send its request
REQUEST_WAIT_S = 1.0
#: how often an answered connection is asked whether its client read the reply
UNREAD_CHECK_S = 1.0
#: what the messages after the first carry besides their fds
MORE = b"\x00"

#: (the caller, its supplementary groups if asked, request) -> (handles, fds), or ProtocolError
Answer = Callable[[Credentials, GroupSource, Any], "tuple[list[bytes], list[int]]"]


class FdChannelServer:
    """The daemon's half, driven by the daemon's poller."""

    def __init__(self, path: str, gid: int | None, answer: Answer, room: FdRoom, dropped: Tally) -> None:
        self.path = path  # free: the daemon took its lock, and cleared a socket one that is gone left there
        self._answer = answer
        self._room = room  # a place for each connection kept open for its unread reply
        self._dropped = dropped  # replies that could not go out, counted (a client that leaves at once can flood)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._listener.setblocking(False)
        self._listener.bind(path)
        secure_socket(path, gid)
        self._listener.listen(MAX_CONNECTIONS)
        self._open: dict[int, tuple[socket.socket, float, int]] = {}  # fd -> (connection, deadline, uid), oldest first
        self._unread: dict[int, tuple[socket.socket, float, int]] = {}  # fd -> (connection, next look, uid): answered
        # with fds its client has not read yet
        self._quiet: set[int] = set()  # those of them at EOF (half-closed): polled no more, looked at by time
        self._poller: zmq.Poller | None = None

    def attach(self, poller: zmq.Poller) -> None:
        self._poller = poller
        poller.register(self._listener.fileno(), zmq.POLLIN)

    def next_deadline(self) -> float | None:
        return min((entry[1] for entry in (*self._open.values(), *self._unread.values())), default=None)

    def serve(self, events: dict, now: float) -> None:
        """One pass: answer what arrived, accept who came, drop who overstayed or read its reply."""
        for fd, (_, look, _) in list(self._unread.items()):
            if fd in events or look <= now:  # it closed (its end's hang-up is an event) or may have read
                self._settle(fd, now)
        for fd in [fd for fd in events if fd in self._open]:
            self._respond(fd, now)
        if self._listener.fileno() in events:
            self._accept(now)
        for fd, (_, deadline, _) in list(self._open.items()):
            if deadline > now:
                break
            self._drop(fd)

    def close(self) -> None:
        for fd in [*self._open, *self._unread]:
            self._drop(fd)
        self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _accept(self, now: float) -> None:
        for _ in range(MAX_CONNECTIONS):  # what the backlog holds, no more per pass
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:  # out of fds: the connection waits in the backlog
                log.warning("cannot accept on the fd channel: %s", err)
                return
            conn.setblocking(False)
            try:
                uid = peer_credentials(conn).uid
            except OSError:  # it left already
                conn.close()
                continue
            self._make_room(uid)
            self._open[conn.fileno()] = (conn, now + REQUEST_WAIT_S, uid)
            self._poller.register(conn.fileno(), zmq.POLLIN)
            self._respond(conn.fileno(), now)  # a client sends its request right after connect: no turn lost

    def _make_room(self, uid: int) -> None:
        """Room for one more connection of ``uid``: a flood of idle connections pushes out only the
        flooder's own, so a request another user has just connected for is still read."""
        by_uid: dict[int, list[int]] = {}
        for fd, (_, _, owner) in self._open.items():
            by_uid.setdefault(owner, []).append(fd)
        if len(by_uid.get(uid, ())) >= MAX_CONNECTIONS_PER_UID:
            self._drop(by_uid[uid][0])
        elif len(self._open) >= MAX_CONNECTIONS:
            self._drop(max(by_uid.values(), key=len)[0])

    def _unread_at_cap(self, uid: int, now: float) -> bool:
        """Whether ``uid`` holds MAX_UNREAD_PER_UID unread replies, each looked at again first (a client
        that read a moment ago is not counted)."""
        mine = [fd for fd, (_, _, owner) in self._unread.items() if owner == uid]
        if len(mine) < MAX_UNREAD_PER_UID:
            return False
        for fd in mine:
            self._settle(fd, now)
        return sum(owner == uid for _, _, owner in self._unread.values()) >= MAX_UNREAD_PER_UID

    def _settle(self, fd: int, now: float) -> None:
        """Drop an answered connection once its reply left the send queue (read, or purged by a close);
        else look again later. What the client sends after its request is discarded, and a client at
        EOF (half-closed) is polled no more, so neither keeps the loop busy."""
        conn, _, uid = self._unread[fd]
        ended = False
        with contextlib.suppress(OSError):
            for _ in range(8):
                if not conn.recv(1, socket.MSG_DONTWAIT):  # a whole message goes, however long
                    ended = True
                    break
        try:
            queued = struct.unpack("i", fcntl.ioctl(fd, termios.TIOCOUTQ, bytes(4)))[0]  # SIOCOUTQ: unread bytes
        except OSError:
            queued = 0
        if not queued:
            self._drop(fd)
            return
        self._unread[fd] = (conn, now + UNREAD_CHECK_S, uid)
        if ended and fd not in self._quiet:
            self._quiet.add(fd)
            self._poller.unregister(fd)

    def _respond(self, fd: int, now: float) -> None:
        conn, _, uid = self._open[fd]
        try:
            # no room for ancillary data: fds a client sends are discarded by the kernel
            data, _, flags, _ = conn.recvmsg(MAX_REQUEST_BYTES + 1)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data, flags = b"", 0
        if data and not flags & socket.MSG_TRUNC and len(data) <= MAX_REQUEST_BYTES:
            share = self._room.size is None or len(self._unread) < self._room.size * UNREAD_FD_SHARE
            placed = share and self._room.take()  # held while its reply stays unread
            refusal = self._refusal(uid, now, share, placed)
            reply, fds = self._reply(conn, data) if refusal is None else (
                {"ok": False, "code": ErrorCode.LIMIT_EXCEEDED.value, "message": refusal}, [])
            if self._send(conn, reply, fds) and fds:  # fds in flight: counted until read, even a part
                del self._open[fd]
                self._unread[fd] = (conn, now, uid)  # looked at in this very pass: a quick client read it already
                return
            if placed:
                self._room.give()
        self._drop(fd)

    def _refusal(self, uid: int, now: float, share: bool, placed: bool) -> str | None:
        """Why a request gets no fds now (LIMIT_EXCEEDED), or None: unread replies hold their share of the
        daemon's fd room, the room is full, or its uid's unread replies are at their cap."""
        if not share:
            return (f"{len(self._unread)} fd channel replies are still unread, their share of the daemon's fd room "
                    f"({UNREAD_FD_SHARE:.0%} of {self._room.size}): processes that ask for fds and never read them "
                    "hold them; stop them, or raise the daemon's hard fd limit (LimitNOFILE= in the unit)")
        if not placed:
            return f"the daemon cannot keep another fd channel connection open for its reply: {self._room.describe()}"
        if self._unread_at_cap(uid, now):
            return (f"uid {uid} has {MAX_UNREAD_PER_UID} fd channel replies it has not read (their file "
                    "descriptors are in flight): a process of this user asks for fds and never reads them; stop it")
        return None

    def _reply(self, conn: socket.socket, data: bytes) -> tuple[dict, list[int]]:
        who = peer_credentials(conn)
        try:
            try:
                request = msgpack.unpackb(data, raw=False, strict_map_key=True)
            except Exception:
                raise ProtocolError(ErrorCode.BAD_REQUEST, "an fd request is one msgpack map") from None
            handles, fds = self._answer(who, lambda: peer_groups(conn), request)
        except ProtocolError as err:
            return {"ok": False, "code": err.code.value, "message": err.message}, []
        except Exception as err:  # a bug must cost one request, never the daemon
            log.exception("fd request of pid %d failed", who.pid)
            return {"ok": False, "code": ErrorCode.INTERNAL.value, "message": f"{type(err).__name__}: {err}"}, []
        place = {fd: n for n, fd in enumerate(dict.fromkeys(fds))}  # each distinct fd, in first-seen order
        if len(place) == len(fds):
            return {"ok": True, "handles": handles}, fds
        return {"ok": True, "handles": handles, "fd_index": [place[fd] for fd in fds]}, list(place)

    def _send(self, conn: socket.socket, reply: dict, fds: list[int]) -> int:
        """Send the reply with its fds; how many of its messages went out (each with its fds in flight)."""
        chunks = [fds[i:i + FDS_PER_MESSAGE] for i in range(0, len(fds), FDS_PER_MESSAGE)] or [[]]
        sent = 0
        try:
            for chunk in chunks:
                socket.send_fds(conn, [msgpack.packb(reply, use_bin_type=True) if sent == 0 else MORE], chunk)
                sent += 1
        except OSError as err:  # EAGAIN: it does not read; anything else: it left
            self._dropped.add(err.strerror or str(err))
            if err.errno == errno.ETOOMANYREFS and sent == 0:  # the client still reads: tell it why, with no fd
                with contextlib.suppress(OSError):
                    conn.send(msgpack.packb({"ok": False, "code": ErrorCode.LIMIT_EXCEEDED.value, "message": (
                        "the daemon cannot pass file descriptors now: its user has too many in flight in replies "
                        "other processes have not read (ETOOMANYREFS); run it with CAP_SYS_RESOURCE, as the "
                        "shipped systemd unit does, or stop the process that does not read them")}))
        return sent

    def _drop(self, fd: int) -> None:
        entry = self._open.pop(fd, None)
        if entry is None:
            entry = self._unread.pop(fd)
            self._room.give()
        conn = entry[0]
        if fd in self._quiet:
            self._quiet.discard(fd)
        else:
            self._poller.unregister(fd)
        conn.close()


def fetch_fds(path: str, slot: dict, timeout: float, daemon_pid: int | None = None,
              daemon_uid: int | None = None) -> tuple[list[bytes], list[int]]:
    """The worker's half: the handles and fds of the set in which this process holds ``slot``: one fd
    per handle, in their order, handles in one chunk sharing one fd (close each distinct fd once).

    ``slot`` is ``{group, name, rank}``. ``daemon_uid`` and ``daemon_pid``,
    where given, must be the uid and pid the kernel reports for the channel's
    server (as for the daemon's own socket), so memory from any other process
    is refused. The kernel reports pid 0 for a daemon outside this process's
    pid namespace (a worker in a pod), where only the uid can be compared.
    The daemon's refusal raises ProtocolError with its code; a daemon that
    cannot be reached (or an impostor), OSError.
    """
    with FdRequest(path, slot, timeout, daemon_pid, daemon_uid) as request:
        return request.reply()


class FdRequest:
    """``fetch_fds`` in two halves: the request goes out at construction, the reply is read by
    ``reply()``, so a worker does other work (a GPU open) while the daemon answers. Raises as
    ``fetch_fds`` does; ``close()`` (or the with block) drops a reply never read, fds included."""

    def __init__(self, path: str, slot: dict, timeout: float, daemon_pid: int | None = None,
                 daemon_uid: int | None = None) -> None:
        self.path, self._slot, self._daemon_pid, self._daemon_uid = path, slot, daemon_pid, daemon_uid
        self._deadline = time.monotonic() + timeout
        self._pause_s = 0.005
        self._sock = self._ask()

    def _ask(self) -> socket.socket:
        """A connection that carries the request, asked again on a new one where the daemon hung up
        before it read it (it makes room for a user's newer connections past MAX_CONNECTIONS_PER_UID
        unanswered ones), until the request's deadline."""
        while True:
            try:
                return self._send()
            except (BrokenPipeError, ConnectionResetError):
                self._wait_to_ask_again()

    def _send(self) -> socket.socket:
        sock = connect(self.path, self._deadline - time.monotonic())
        try:
            server = peer_credentials(sock)
            if self._daemon_uid is not None and server.uid != self._daemon_uid:
                raise ConnectionError(
                    f"the fd channel at {self.path} is served by {describe_uid(server.uid)} (pid {server.pid}), not "
                    f"by the daemon's user ({describe_uid(self._daemon_uid)}); refusing its memory: check who "
                    "created that socket"
                )
            if self._daemon_pid is not None and server.pid not in (0, self._daemon_pid):
                raise ConnectionError(
                    f"the fd channel at {self.path} is served by pid {server.pid}, not by the daemon (pid "
                    f"{self._daemon_pid}); refusing its memory: check who created that socket"
                )
            sock.send(msgpack.packb(self._slot, use_bin_type=True))
        except BaseException:
            sock.close()
            raise
        return sock

    def _wait_to_ask_again(self) -> None:
        if time.monotonic() + self._pause_s >= self._deadline:
            raise ConnectionError(f"the daemon's fd channel at {self.path} hung up before it read this "
                                  "process's request, until its deadline (it drops a user's oldest connections "
                                  f"past {MAX_CONNECTIONS_PER_UID} unanswered ones)")
        time.sleep(self._pause_s)
        self._pause_s = min(self._pause_s * 2, 0.1)

    def reply(self) -> tuple[list[bytes], list[int]]:
        """The handles and their fds, as ``fetch_fds`` returns them; waits until the request's deadline."""
        path = self.path
        fds: list[int] = []
        try:
            handles: list[bytes] | None = None
            index: list[int] = []
            distinct = 0
            while handles is None or len(fds) < distinct:
                _wait_at_most(self._sock, self._deadline - time.monotonic())
                try:
                    data, received, flags, _ = socket.recv_fds(
                        self._sock, MAX_REPLY_BYTES, FDS_PER_MESSAGE, socket.MSG_CMSG_CLOEXEC
                    )
                except ConnectionResetError:  # hung up on with the request still unread in the connection
                    data, received, flags = b"", [], 0
                if handles is None and not data and not received:  # hung up on: the request was never read
                    self._sock.close()
                    self._wait_to_ask_again()
                    self._sock = self._ask()
                    continue
                fds += received
                if flags & socket.MSG_CTRUNC:
                    raise ConnectionError(
                        f"this process could not take every fd the daemon's fd channel at {path} sent; "
                        "is it at its open-file limit (ulimit -n)?"
                    )
                if flags & socket.MSG_TRUNC or not data:
                    raise ConnectionError(f"the daemon's fd channel at {path} cut its reply short")
                if handles is None:
                    handles, index = _handles_of(msgpack.unpackb(data, raw=False))
                    distinct = len(set(index))
            if len(fds) != distinct:
                raise ConnectionError(f"the daemon's fd channel at {path} sent {len(fds)} fds for {distinct}")
            return handles, [fds[i] for i in index]
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        finally:
            self.close()

    def close(self) -> None:
        """Hang up; fds the daemon sent and nobody read are closed with the socket's queue."""
        self._sock.close()

    def __enter__(self) -> "FdRequest":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def connect(path: str, timeout: float) -> socket.socket:
    """A connection to the channel, waiting up to ``timeout`` while the daemon's backlog is full.

    Blocking, with kernel timeouts: a non-blocking connect to a unix socket
    fails at once with EAGAIN when the backlog is full, rather than waiting.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        _wait_at_most(sock, timeout)
        sock.connect(path)
    except BaseException:
        sock.close()
        raise
    return sock


def _wait_at_most(sock: socket.socket, seconds: float) -> None:
    """Each later send, connect or receive fails with EAGAIN after ``seconds``."""
    seconds = max(seconds, 0.001)
    timeval = struct.pack("@ll", int(seconds), int(seconds % 1 * 1_000_000))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)


def _handles_of(reply: Any) -> tuple[list[bytes], list[int]]:
    """The reply's handles, and for each the place of its fd among the fds sent."""
    if not isinstance(reply, dict) or not isinstance(reply.get("ok"), bool):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "the daemon's fd channel sent a reply without 'ok'")
    if not reply["ok"]:
        try:
            code = ErrorCode(reply.get("code"))
        except ValueError:
            code = ErrorCode.INTERNAL
        raise ProtocolError(code, str(reply.get("message", "")))
    handles = list(reply["handles"])
    index = reply.get("fd_index", list(range(len(handles))))
    if (not isinstance(index, list) or len(index) != len(handles) or not all(type(i) is int for i in index)
            or sorted(set(index)) != list(range(len(set(index))))):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "the daemon's fd channel sent an fd_index that fits no handles")
    return handles, index
