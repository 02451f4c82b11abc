"""A worker's one connection to the daemon: request, then the reply with that id.

One DEALER per process, opened on first use. Each call waits for the reply
carrying its id against one monotonic deadline; replies to earlier calls
that gave up are dropped. A socket monitor reports the connection dropping
(the daemon died or restarted; ZeroMQ heartbeats catch a daemon that stopped
answering), so a call waiting on a dead daemon fails within a heartbeat
instead of hanging, and the next call says the daemon went away.

A call whose deadline passes first reads every reply already queued, then
asks the daemon a ``hello`` probe: replies come in order, so the probe's
answer proves the call's own will not come. A process stopped (SIGSTOP)
through its deadline thus still sees the verdict that came meanwhile.

Releases are fire and forget, and must not be lost with a connection: one
that cannot go out (the daemon stalled past the heartbeat, or restarted)
waits in a process-wide queue, sent on the next connection and retried in
the background until a daemon answers, so a worker that closes gets its
memory released once the daemon is back.

Fork guard: a forked child must not share its parent's socket. The child
starts with no connection and opens its own on first use; it inherits no
undelivered release (those are its parent's ranks).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import math
import os
import socket
import struct
import sys
import threading
import time
from typing import Any, Callable

import zmq

from peerd.paths import check_socket_path, default_socket, endpoint
from peerd.protocol import (
    MAX_FRAME_BYTES, MAX_TIMEOUT_S, VERSION, ProtocolError, Reply, check_fields, decode_reply, encode_request,
    is_wait,
)
from peerd.ops import OPS, check_reply, validate_request
from peerd.trust import (
    DAEMON_USER_ADVICE,
    SocketPathError,
    UntrustedPath,
    check_socket,
    client_trusts,
    credentials,
    describe_trusted,
    describe_uid,
)
from peerd.routingids import new_routing_id
from peerd.turnlock import TurnLock

from .errors import DaemonUnavailable, MonoUnsupported
from .mappings import DaemonRun, mappings


#: drops before hello's answer that tell a connection cap (each reconnect shut down at once) from a restart
DROPS_THAT_ARE_A_CAP = 3
#: why a daemon closes a connection before a word: its caps (peerd.connections), else it was stopping
SHUT_DOWN_ADVICE = ("this user may be at its cap on connections (--max-connections-per-uid, or --max-connections for "
                    "every user; the daemon's log says which): close some of this user's connections to it, or ask "
                    "its operator to raise the cap; else the daemon was stopping")


def seconds_from_env(name: str, default: float) -> float:
    """``name``'s seconds, or ``default`` with one warning when it is not a number in (0, MAX_TIMEOUT_S].

    Warned, not raised: this runs at import, in every worker, and the value
    is imported by name elsewhere; a typo must not stop the job, and -1 or
    inf must not mean waiting forever on a dead daemon.
    """
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if is_wait(seconds):
        return seconds
    logging.getLogger("peerd_client").warning(
        "%s=%r is not a number of seconds in (0, %g]; using the default %gs", name, raw, MAX_TIMEOUT_S, default)
    return default


CONNECT_TIMEOUT_S = seconds_from_env("PEERD_CONNECT_TIMEOUT", 5.0)
#: a turn on the connection waited for less than this was not contended: the wait sent stays the caller's own
TURN_SLACK_S = 0.001
REQUEST_TIMEOUT_S = seconds_from_env("PEERD_REQUEST_TIMEOUT", 10.0)
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 3000
#: how much longer than the daemon's own deadline a client waits for its verdict
GRACE_S = 5.0
#: how long a call past its deadline waits for the answer to its probe
PROBE_TIMEOUT_S = 2.0
#: undelivered releases are retried after this long, the wait doubling up to the most, until delivered
RETRY_EVERY_S = 1.0
RETRY_MOST_EVERY_S = 30.0
CLOSED = "closed"


def listened_at(path: str) -> bool:
    """Whether a process listens on the Unix socket at ``path``: a refused connect says the socket file is
    left from a daemon that stopped (ZeroMQ would retry it quietly until the hello times out)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK) as probe:
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError:  # a full backlog (EAGAIN) or a permission problem: not this check's to judge
            return True
    return True


class Connection:
    def __init__(self, path: str, connect_timeout: float = CONNECT_TIMEOUT_S):
        self.path = check_socket_path(path)
        self.pid = os.getpid()
        self._lock = TurnLock()  # a Ctrl-C must not leave it held (peerd.turnlock: how it is taken and let go)
        self._ids = itertools.count(1)
        self._lost: str | None = None
        self._owner: int | None = None  # the thread inside call() or post(), if any
        # requests no one waits for, from threads that could not take the socket (a deque: appended without the
        # lock); the thread holding it sends them, woken through the socket pair if it is waiting (see send_later)
        self._deferred: collections.deque[tuple[str, dict]] = collections.deque()
        self._wake_r, self._wake_w = socket.socketpair()  # objects: once closed, a late write fails, never lands
        self._wake_r.setblocking(False)  # on whatever file reused the number
        self._wake_w.setblocking(False)
        try:
            trusted = client_trusts()
            check_socket(self.path, trusted)
        except FileNotFoundError:
            raise DaemonUnavailable(
                f"no peerd daemon socket at {self.path}: start one with `peerd serve`, "
                "or point PEERD_SOCKET at the socket of the one that runs"
            ) from None
        except SocketPathError as err:
            raise DaemonUnavailable(str(err), err.code) from None
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        for option, value in (
            (zmq.LINGER, 0),
            (zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS),
            (zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS),
            (zmq.MAXMSGSIZE, MAX_FRAME_BYTES),
            (zmq.ROUTING_ID, new_routing_id()),  # the daemon answers no name another process could take
        ):
            self._sock.setsockopt(option, value)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._poller = zmq.Poller()  # one per connection: the round trip is the hot path
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._sock.connect(endpoint(self.path))
        try:
            self.hello = self._greet(trusted, connect_timeout)
        except MonoUnsupported:
            self.close()
            raise
        if self.hello.get("protocol") != VERSION:
            self.close()
            raise DaemonUnavailable(
                f"the daemon at {self.path} speaks protocol {self.hello.get('protocol')}, "
                f"this client {VERSION}: upgrade them together"
            )
        self.run: DaemonRun = (self.hello["pid"], self.hello.get("instance"))  # which daemon run answered

    def _greet(self, trusted: frozenset[int], timeout: float) -> dict[str, Any]:
        """hello, answered by a daemon whose uid, as the kernel reports it, this process trusts.

        The first exchange of a fresh socket, so the first frame is its answer,
        and nothing in it is used before its sender's credentials are checked.
        No later reply is taken once the connection was seen to drop
        (``_await`` reads the monitor first: its event is queued before the
        socket reconnects): ZeroMQ reconnects by itself, and where the
        socket's directory lets another user bind the path once the daemon is
        gone, a reply could otherwise come from that user's process.
        """
        self._sock.send(encode_request(next(self._ids), "hello", {}))
        deadline = time.monotonic() + timeout  # the whole wait: a supervisor may be restarting it
        drops = 0  # one drop may be a restart, whose next daemon still gets the hello; each reconnect shut down
        while not self._sock.poll(0):  # at once is a cap (peerd.connections): no answer is coming
            drops += self._dropped()
            if drops >= DROPS_THAT_ARE_A_CAP:
                raise DaemonUnavailable(f"peerd daemon at {self.path} closed this connection {drops} times before "
                                        f"answering hello: {SHUT_DOWN_ADVICE}")
            left = deadline - time.monotonic()
            if left <= 0:
                why = ("nobody listens there: the socket is left from a daemon that stopped; start one with `peerd "
                       "serve` (it replaces a stale socket), or point PEERD_SOCKET at the one that runs"
                       if not listened_at(self.path) else
                       f"it closed this connection before answering: {SHUT_DOWN_ADVICE}" if drops else
                       "it accepts connections but its loop does not answer")
                raise DaemonUnavailable(f"peerd daemon at {self.path} did not answer hello within {timeout:g}s: {why}")
            self._poller.poll(int(left * 1000) + 1)
        frame = self._sock.recv(copy=False)
        sender = credentials(frame)
        if sender is None or sender.uid not in trusted:
            who = "an unknown user" if sender is None else f"{describe_uid(sender.uid)}, pid {sender.pid}"
            raise DaemonUnavailable(
                f"refusing the daemon at {self.path}: it runs as {who}, which this process does not trust "
                f"(trusted: {describe_trusted(trusted)}); it could be another user's impostor. {DAEMON_USER_ADVICE}",
                UntrustedPath.code,
            )
        self.daemon_uid = sender.uid  # as the kernel reports it
        try:
            reply = decode_reply(frame.bytes)
        except ProtocolError as err:
            raise MonoUnsupported(f"peerd daemon sent a bad reply to hello: {err.message}", err.code.value)
        if not reply.ok:
            raise MonoUnsupported(reply.error.message, reply.error.code.value)
        return reply.body

    def close(self) -> None:
        if os.getpid() != self.pid:
            return  # a forked child must not tear down its parent's sockets
        if not self._lock.acquire():
            raise RuntimeError("Connection.close() from inside a call of this thread's")
        try:
            self._close_sockets()
        finally:
            self._lock.release()

    def _close_sockets(self) -> None:
        if self._lost == CLOSED:
            return
        self._lost = CLOSED  # PeerBuffers still holding this connection get DaemonUnavailable
        self._hand_over_deferred()
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        self._ctx.term()
        self._wake_r.close()
        self._wake_w.close()

    def _check_lost(self) -> None:
        if self._lost == CLOSED:
            raise DaemonUnavailable(f"this connection to {self.path} was closed (the daemon went away earlier)")
        if self._dropped():
            self._lost = ("the connection dropped: the daemon died, was restarted or stopped answering, or shut it "
                          "down over a cap on connections, which its log names")
        if self._lost:
            raise DaemonUnavailable(f"peerd daemon at {self.path} went away ({self._lost})")

    def _dropped(self) -> int:
        """How many times the monitor has reported the connection dropped since it was last read."""
        dropped = 0
        while self._monitor.poll(0):
            # a monitor event is (uint16 event, uint32 value), then the endpoint; parsed
            # here because zmq.utils.monitor imports asyncio, 40 ms of every worker's start
            event = struct.unpack("=H", self._monitor.recv_multipart()[0][:2])[0]
            dropped += event == zmq.EVENT_DISCONNECTED
        return dropped

    def call(self, op: str, body: dict[str, Any], timeout: float = REQUEST_TIMEOUT_S,
             meanwhile: Callable[[], None] | None = None) -> dict[str, Any]:
        """Send one request; its reply body, or the daemon's error as MonoUnsupported.

        ``meanwhile`` runs once the request is out, before waiting: work that overlaps the daemon's answer.
        Calls of one process's threads take turns on the connection; a call still waiting for its turn
        when ``timeout`` has passed raises MonoUnsupported (TIMEOUT) without having sent anything.
        """
        started = time.monotonic()

        def once_held() -> dict[str, Any]:
            """The request, its wait (``body["timeout"]``: the daemon's) shortened by the turn waited for, as
            the client's own is: else the client gave up first, on a daemon that was only keeping time."""
            waited = time.monotonic() - started
            daemon_wait = body.get("timeout")
            sent = body
            if isinstance(daemon_wait, (int, float)) and daemon_wait > 0 and waited >= TURN_SLACK_S:
                if daemon_wait - waited <= 0:
                    raise MonoUnsupported(
                        f"{op} waited its whole {daemon_wait:g}s for another thread of this process to finish its "
                        "call to the daemon: nothing was sent", "TIMEOUT")
                sent = {**body, "timeout": daemon_wait - waited}
            return self._call(op, sent, max(0.0, timeout - waited), meanwhile)

        held, reply = self._holding(timeout, once_held)
        if not held:
            raise MonoUnsupported(
                f"{op} waited {timeout:g}s for another thread of this process to finish its call to the daemon "
                "(a rendezvous or a vote): calls of one process's threads take turns on its connection",
                "TIMEOUT")
        return reply

    def post(self, op: str, body: dict[str, Any]) -> None:
        """Send one request whose answer comes another way (a commit's no, from the control page): the
        daemon answers it only with a refusal, which the next call skips as stray. Where another
        thread holds the connection, that thread sends it."""
        held, _ = self._holding(0, lambda: self._send(op, self._ready(op, body)))
        if not held:
            self.send_later(op, _checked(op, body))

    def call_unless_busy(self, op: str, body: dict[str, Any], timeout: float = REQUEST_TIMEOUT_S) -> None:
        """A request whose answer nobody needs but this thread would rather wait for (a release):
        answered before this returns, or DaemonUnavailable once ``timeout`` passed without an answer
        (no probe of a stopped process: nobody needs it), unless another thread is inside a call (a
        rendezvous may wait a minute): then that thread sends it at once, woken, and this one does not wait."""
        held, _ = self._holding(0, lambda: self._call(op, body, timeout, probe=False))
        if not held:
            self.send_later(op, body)

    def _holding(self, timeout: float, work: Callable[[], Any]) -> tuple[bool, Any]:
        """(True, ``work()``) run by this thread holding the connection; (False, None) where another thread
        held it for ``timeout`` seconds (0: at all), or this one does (a finalizer's send_later then
        defers instead of waiting). Then what other threads left meanwhile is sent. The take and the
        release are where a Ctrl-C cannot leave the connection held (peerd.turnlock)."""
        if not (self._lock.acquire(timeout=timeout) if timeout > 0 else self._lock.acquire(blocking=False)):
            self._flush_deferred()
            return False, None
        try:
            self._owner = threading.get_ident()
            return True, work()
        finally:
            self._owner = None
            self._lock.release()
            self._flush_deferred()  # whatever the call raised: what other threads left while this one held it

    def notice_loss(self) -> None:
        """Read what the monitor reported since the last call (the daemon died or restarted), so
        the next user gets a fresh connection instead of this dead one's DaemonUnavailable; left to
        the thread holding the socket where one does."""
        if self._lock.acquire(blocking=False):
            try:
                with contextlib.suppress(DaemonUnavailable):
                    self._check_lost()
            finally:
                self._lock.release()

    def _ready(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` checked, once the connection is known alive and the deferred requests went out."""
        self._send_deferred()
        return _checked(op, body)

    def _call(self, op: str, body: dict[str, Any], timeout: float,
              meanwhile: Callable[[], None] | None = None, probe: bool = True) -> dict[str, Any]:
        request_id = self._send(op, self._ready(op, body))
        deadline = time.monotonic() + timeout
        if meanwhile is not None:
            meanwhile()
        reply = self._await(op, (request_id,), deadline)
        if reply is None and probe and op != "hello":  # past the deadline: did its answer come while this process
            # was stopped?
            reply = self._await(op, (request_id, self._send("hello", {})), time.monotonic() + PROBE_TIMEOUT_S)
        if reply is None or reply.id != request_id:
            raise DaemonUnavailable(f"peerd daemon at {self.path} did not answer {op} within {timeout:g}s")
        if not reply.ok:
            raise MonoUnsupported(reply.error.message, reply.error.code.value)
        try:
            check_reply(op, reply.body)
        except ProtocolError as err:
            raise MonoUnsupported(f"peerd daemon sent a bad reply to {op}: {err.message}", err.code.value) from None
        return reply.body

    def _send_deferred(self) -> None:
        """Send what other threads left for the socket's holder (this thread), once the connection is
        known alive; on a lost one they wait for the next connection, and DaemonUnavailable is raised."""
        try:
            self._check_lost()
        except DaemonUnavailable:
            self._hand_over_deferred()
            raise
        while self._deferred:
            self._send(*self._deferred.popleft())

    def _flush_deferred(self) -> None:
        """Send what other threads left for the socket, unless a thread holds it (that one sends them):
        looked at again after each let-go, so a request left meanwhile is never stranded."""
        while self._deferred and self._lock.acquire(blocking=False):
            try:
                self._send_deferred()
            except DaemonUnavailable:
                pass  # they wait for the next connection
            finally:
                self._lock.release()

    def _hand_over_deferred(self) -> None:
        """This connection is gone: what other threads left for it waits for the next one."""
        while True:
            try:
                undelivered.add(*self._deferred.popleft())
            except IndexError:
                return

    def _send(self, op: str, body: dict[str, Any]) -> int:
        request_id = next(self._ids)
        self._sock.send(encode_request(request_id, op, body))
        return request_id

    def _await(self, op: str, ids: tuple[int, ...], deadline: float) -> Reply | None:
        """The first reply to one of ``ids``; None once the deadline passed and no reply is left queued."""
        while True:
            left = deadline - time.monotonic()
            events = dict(self._poller.poll(int(left * 1000) + 1 if left > 0 else 0))
            if self._sock in events:
                self._check_lost()  # see _greet: no reply is taken once the connection was seen to drop
                try:
                    reply = decode_reply(self._sock.recv())
                except ProtocolError as err:
                    raise MonoUnsupported(f"peerd daemon sent a bad reply to {op}: {err.message}", err.code.value)
                if reply.id in ids:
                    return reply
                continue  # the late answer to a call that gave up
            if self._wake_r.fileno() in events:  # another thread left a request (zmq reports plain sockets by fd)
                with contextlib.suppress(BlockingIOError):
                    self._wake_r.recv(4096)
                with contextlib.suppress(DaemonUnavailable):  # lost: the monitor's event below says so
                    self._send_deferred()
            if left <= 0:
                return None
            if self._monitor in events or self._lost:  # the wake above may have read the monitor's event
                self._check_lost()

    def send_later(self, op: str, body: dict[str, Any]) -> None:
        """Send a request whose answer nobody waits for (its reply is skipped as stray).

        For finalizers, so it never waits: the request goes to the thread
        holding the socket, which sends it at once from its wait (woken
        through a socket pair) or before it lets go, or, where no thread holds the
        socket, out now from this one. A garbage-collection pass inside
        call() on this very thread is the first case. On a connection that
        was lost it waits for the next one.
        """
        self._deferred.append((op, body))
        with contextlib.suppress(OSError):  # full: the holder is woken already; closed: the connection is gone
            self._wake_w.send(b"\0")
        if self._owner == threading.get_ident():
            return  # inside call() on this thread: it sends it before it lets go
        self._flush_deferred()
        if self._lost == CLOSED:  # closed meanwhile: nobody holds this connection any more
            self._hand_over_deferred()


def _as_refusal(check: Callable[[], Any]) -> Any:
    """``check()``, its ProtocolError raised as the MonoUnsupported a worker catches (the code kept)."""
    try:
        return check()
    except ProtocolError as err:
        raise MonoUnsupported(err.message, err.code.value) from None


def _checked(op: str, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` as validated for ``op``: a bad call fails here, with the field named, not in the daemon."""
    return _as_refusal(lambda: validate_request(op, body))


def checked_fields(where: str, op: str, values: dict[str, Any]) -> None:
    """MonoUnsupported (BAD_REQUEST) naming the first of ``values`` that ``op``'s request refuses: checked
    before anything is sent or waits on them, so a rank can tell its peers instead of only raising."""
    schema = OPS[op].request
    _as_refusal(lambda: check_fields(where, {name: schema[name] for name in values}, values, closed=True))


def checked_timeout(where: str, timeout: float | None) -> None:
    """MonoUnsupported (BAD_REQUEST) naming ``timeout`` unless it is a wait the protocol carries (or None
    for the daemon's default): checked before anything waits on it (an infinite one overflowed a lock's
    wait, a string failed in arithmetic)."""
    checked_fields(where, "agree", {"timeout": timeout})


class Undelivered:
    """Fire-and-forget requests (releases) that no connection delivered yet.

    Sent on the next connection, and retried by a background thread while
    any wait (after RETRY_EVERY_S, then twice as long each time up to
    RETRY_MOST_EVERY_S), however long the daemon is away. An entry is done
    once a daemon answered it at all: NOT_FOUND from a restarted daemon means
    it freed everything already. A deque, so a finalizer may add to it from
    inside a flush without a lock to deadlock on.
    """

    def __init__(self) -> None:
        self._entries: collections.deque[tuple[str, dict]] = collections.deque()
        self._retrying: threading.Thread | None = None
        # one flush at a time, so connection() returns only once what the retry thread had taken went out: a
        # release naming no set, delivered after this process joined its slot again, freed the new set
        self._flushing = threading.RLock()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, op: str, body: dict[str, Any]) -> None:
        self.extend([(op, body)])

    def extend(self, requests: list[tuple[str, dict]]) -> None:
        if not requests:
            return
        self._entries.extend(requests)
        if sys.is_finalizing():  # a buffer collected at exit: no thread may start now (3.10 and 3.11 hang in
            return  # Thread.start); the daemon frees a dead process's ranks
        if self._retrying is None or not self._retrying.is_alive():
            try:
                self._retrying = threading.Thread(target=self._retry, name="peerd-release-retry", daemon=True)
                self._retrying.start()
            except RuntimeError:  # the interpreter is exiting: the daemon frees a dead process's ranks
                pass

    def flush(self, conn: Connection) -> None:
        """Deliver every waiting request over ``conn``; stop at the first the daemon does not answer. Returns
        once any flush under way in another thread is done too: what it took went out before what follows."""
        with self._flushing:
            self._flush(conn)

    def _flush(self, conn: Connection) -> None:
        for _ in range(len(self._entries)):
            try:
                op, body = self._entries.popleft()
            except IndexError:
                return
            try:
                conn.call_unless_busy(op, body)  # where another thread holds the connection, it sends this
            except DaemonUnavailable:
                self._entries.appendleft((op, body))
                return
            except MonoUnsupported:
                pass  # answered: NOT_FOUND or a failure verdict, nothing is held for it any more

    def _retry(self) -> None:
        wait = RETRY_EVERY_S
        while True:
            if not self._entries:
                self._retrying = None
                if not self._entries or self._retrying is not None:  # none came meanwhile, or extend started
                    return  # the next thread
                self._retrying = threading.current_thread()
            time.sleep(wait)
            wait = min(2 * wait, RETRY_MOST_EVERY_S)
            try:
                self.flush(connection())
            except Exception:  # no daemon yet, or none at this path (ValueError): try again
                continue

    def forget(self) -> None:
        """A forked child: its parent's releases are not its own, nor its flush under way (its lock with it)."""
        self._entries.clear()
        self._retrying = None
        self._flushing = threading.RLock()


undelivered = Undelivered()


def daemon_answers(path: str, timeout: float = 0.5) -> bool:
    """Whether a daemon answers at path within timeout: for launchers and readiness checks."""
    try:
        Connection(path, connect_timeout=timeout).close()
        return True
    except DaemonUnavailable:
        return False


_connection: Connection | None = None
_connection_lock = threading.Lock()
_daemon_run: DaemonRun | None = None  # the daemon run the last fresh connection reached


def _forget_after_fork() -> None:
    global _connection, _connection_lock, _daemon_run
    _connection, _connection_lock, _daemon_run = None, threading.Lock(), None
    undelivered.forget()


os.register_at_fork(after_in_child=_forget_after_fork)


def _socket_to_use() -> str:
    """The daemon's socket (peerd.paths.default_socket); one libzmq cannot use is a DaemonUnavailable that
    names PEERD_SOCKET, where it came from: no daemon can answer there, and the engine falls back."""
    path = default_socket()
    try:
        return check_socket_path(path)
    except ValueError as err:
        origin = "PEERD_SOCKET" if os.environ.get("PEERD_SOCKET") else "the default socket path"
        raise DaemonUnavailable(f"{origin} names no usable socket: {err}") from None


def connection(starting_over: bool = False) -> Connection:
    """This process's connection, opened on first use or after the daemon went away.

    A call on a connection whose daemon died raises DaemonUnavailable once,
    so every rank hears of the restart; ``starting_over`` (a new PeerBuffer,
    whose whole handshake is still to come) reads the monitor first and
    reconnects at once instead. The releases a lost connection could not
    deliver go out before it is returned, those the retry thread has under
    way too; where a new connection reaches another daemon run, the chunks
    of the one before are unmapped as their buffers close.
    """
    global _connection, _daemon_run
    with _connection_lock:
        if _connection is not None and starting_over:
            _connection.notice_loss()
        if _connection is not None and _connection._lost:
            _connection.close()  # what was left for it waits for the new one
            _connection = None
        if _connection is None:
            _connection = Connection(_socket_to_use())
            if _daemon_run is not None and _connection.run != _daemon_run:
                mappings.retire(_daemon_run)
            _daemon_run = _connection.run
        conn = _connection
    undelivered.flush(conn)  # whatever is queued, or under way in the retry thread, goes out before this call's
    return conn

