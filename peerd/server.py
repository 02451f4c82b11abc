"""The daemon's loop: a ZeroMQ ROUTER in front of the group registry.

One thread does everything, so the registry needs no locks: receive a frame,
read the caller's kernel credentials off it, hand the request to the
registry, deliver the replies it owes, fire due timers, and turn client-pid
deaths into registry events. Signals arrive through a wakeup pipe polled like
any socket, so SIGTERM is handled between two messages, never inside one.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import time
from dataclasses import replace
from typing import Any, Callable, NamedTuple

import msgpack
import zmq

from . import __version__, report
from .admission import admins_of, admit, forbidden
from .access import Allowlist, GroupSource, connection_groups, resolve_groups, secure_socket
from .connections import ConnectionGuard, raise_fd_limit
from .arena import OverCap
from .backends import Allocation, AllocationFailed, MemoryBackend, UnknownDevice
from .fdchannel import FdChannelServer
from .fdroom import FdRoom, room_within
from .handout import member_fds
from .health import StuckSets
from .outbox import Outbox, Send
from .pages import Pages
from .registry import Registry
from .reloader import Reloader
from .routingids import MIN_ID_BYTES, self_named, unpredictable_made_up_ids
from .liveness import POLL_INTERVAL, PidWatcher
from .logbudget import log_budget
from .metrics import Metrics, require_prometheus
from .notify import Notifier
from .paths import endpoint, fd_socket_path
from .ops import OPS, Op, decode_request
from .protocol import (MAX_REQUEST_BYTES, ErrorCode, ProtocolError, encode_error, encode_packed_reply, pack_body,
                       request_id_of)
from .settings import Loader, Settings
from .socketclaim import SocketClaim
from .tally import Tally
from .credentials import Credentials
from .trust import credentials, pid_alive

#: seconds between STATUS= refreshes (and at most between watchdog pings)
TICK_S = 1.0

#: how long closing the socket may wait for the replies already sent to leave
SHUTDOWN_LINGER_MS = 1000

#: what a connection that did not name itself hears (Note [Routing ids] in peerd.routingids)
UNNAMED = (f"this connection has a routing id ZeroMQ made up, or one shorter than {MIN_ID_BYTES} bytes: another "
           f"user could take it and receive the replies; set ZMQ_ROUTING_ID to at least {MIN_ID_BYTES} random "
           "bytes, the first not zero, before connecting (peerd_client does from protocol 4 on: upgrade an older one "
           "with the daemon)")

#: settings a SIGHUP cannot change in a running daemon
RESTART_ONLY = ("socket", "backend", "socket_group", "socket_dir_mode", "metrics_port", "control_pages",
                "arena_chunk_bytes", "arena_max_bytes_per_uid", "arena_idle_s")

#: What one connection can make the daemon hold. A client has one call
#: outstanding, plus a few releases whose replies it skips, so these bind
#: only a client that floods or does not read: past RCVHWM requests its
#: connection waits (libzmq stops reading it); past SNDHWM replies to it are
#: dropped and counted (ROUTER_MANDATORY). A client with at most CLIENT_WINDOW
#: requests in flight that reads its replies never loses one: Note [Reply
#: window]. Worst case per connection: 32 x 8 KiB in, 67 x 32 KiB out.
CLIENT_WINDOW = 32
ROUTER_RCVHWM = CLIENT_WINDOW
ROUTER_SNDHWM = 2 * CLIENT_WINDOW + 2

# Note [Reply window]
# ~~~~~~~~~~~~~~~~~~~
# libzmq counts a reply as queued until the daemon's socket hears that the
# I/O thread took it, and it hears that late twice over: the I/O thread
# reports its reads in batches of half the high-water mark, and the socket
# takes in those reports at most about once a millisecond on sends. So a
# connection whose client had 16 requests in flight, and read every reply,
# was seen full at 32 and lost replies (the throughput benchmark stalled at
# 16 groups). Hence: a send that finds the queue full first takes in every
# report (getsockopt(EVENTS) does, unthrottled) and tries once more; and
# SNDHWM leaves room for a whole unreported batch (SNDHWM / 2 replies) beside
# a full window, and one to spare. A client past the window, or one that does
# not read, still has its replies dropped and counted.

MESSAGES_PER_TURN = CLIENT_WINDOW
TURN_S = 0.01
#: Frames of a message beyond identity + one payload (which no client sends) dropped between two looks
#: at the turn's time: libzmq bounds each frame, not their number, and reading millions of empty ones in
#: one recv_multipart kept the loop (and systemd's watchdog ping) away for half a minute.
DROP_FRAMES_PER_LOOK = 4096
#: glibc's malloc_trim (None elsewhere), and how often a dropped message may cost one
_malloc_trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
TRIM_EVERY_S = 10.0

log = logging.getLogger("peerd.server")


class Route(NamedTuple):
    """Where a reply goes: the connection, the request's id, and what was asked and when (errors are
    checked against the op's record, metrics time the answer)."""

    identity: bytes
    request_id: int | None
    op: str | None = None
    since: float = 0.0


Handler = Callable[[Route, Credentials, dict], Outbox]


def unseen(op: str) -> str:
    """Why a caller the daemon cannot see may not {op}: its death would never free what it held."""
    return (f"the daemon cannot see this process (the kernel reports its pid as 0: it runs in a pid namespace "
            f"outside the daemon's), so it could never tell its death and free what it holds: no {op}; run the "
            "daemon in the host's pid namespace, or in the workers' (Kubernetes: hostPID, docs/kubernetes.md)")


class Daemon:
    def __init__(self, settings: Settings, open_backend: Callable[[], MemoryBackend], loader: Loader | None = None):
        """Every check that can refuse to start comes before ``open_backend``: peerd.socketclaim."""
        self.settings = settings
        self._loader = loader  # reads the settings again on SIGHUP
        self.socket_path = settings.socket
        self.socket_gid, allowed_gids = resolve_groups(settings.socket_group, settings.allow_gid)
        self.allowlist = Allowlist.build(settings.allow_uid, allowed_gids, self.socket_gid)
        if settings.metrics_port:
            require_prometheus()
        self._notifier = Notifier()
        self._claim = SocketClaim(self.socket_path, settings.socket_dir_mode, self.socket_gid)
        self._fd_channel: FdChannelServer | None = None  # made at bind
        try:
            backend = open_backend()
            try:
                self._assemble(backend)
            except BaseException:
                backend.close()
                raise
        except BaseException:  # nothing served: the claim goes, and the socket directory it made
            self._claim.release()
            raise

    def _assemble(self, backend: MemoryBackend) -> None:
        """Everything the loop serves with, around the backend."""
        settings = self.settings
        self.backend = backend
        self._admins = admins_of(os.geteuid())  # who may call the admin-only ops
        self._fd_room = FdRoom()  # sized at bind, from the fd limit: peerd.fdroom
        backend.share_fd_room(self._fd_room)
        self.pages = Pages(settings.control_pages, self._fd_room)  # a control page per live set, in per-uid areas
        self.registry = Registry(
            self._allocate, backend.free, settings.rendezvous_timeout, settings.agreement_timeout, settings.limits,
            admins=self._admins, handed=backend.handed, pages=self.pages, ready=self._ready,
            footprint=backend.footprint, alive=pid_alive,
        )
        self.started = time.monotonic()
        self._watcher = PidWatcher(settings.max_processes_per_uid, self._fd_room)
        self._stopping = False
        self._drain_until: float | None = None  # set by the first SIGTERM/SIGINT
        self._signals: list[int] = []
        self._reload_failed: str | None = None  # why the last SIGHUP changed nothing, until one succeeds
        self._restart_pending: list[str] = []  # the settings a reload read that only a restart applies
        self._next_tick = 0.0
        self.metrics: Metrics | None = None
        self._refused: set[bytes] = set()  # connections already logged as refused
        self._oversized = False  # the router's next frames are the rest of a message no client sends
        self._next_trim = 0.0
        self._dropped = Tally(log, "dropped %d reply(ies)")
        self._malformed = Tally(log, "refused %d malformed message(s)")  # a flood of them is a few lines
        self._outsiders = Tally(log, "refused %d connection(s) outside the allowlist", each=10)
        self._fd_dropped = Tally(log, "fd channel: dropped %d reply(ies) that could not go out")
        self._tallies = (self._dropped, self._malformed, self._outsiders, self._fd_dropped, log_budget)
        self._stuck = StuckSets()  # the stuck sets status reports, found by one walk a second at most
        self._handlers = {name: self._handler(op) for name, op in OPS.items()}
        self._reloader = Reloader(self._read_settings, self._wake_loop)  # SIGHUP's reads, off the loop

    # ------------------------------------------------------------ lifecycle

    def bind(self) -> None:
        """Bind the claimed socket and the fd channel beside it, then announce readiness."""
        self._fd_limit = raise_fd_limit()
        self._fit_to_fd_limit()
        self._ctx = zmq.Context()
        unpredictable_made_up_ids()  # before the ROUTER takes its first: Note [Routing ids]
        self._router = self._ctx.socket(zmq.ROUTER)
        for option, value in ((zmq.LINGER, 0), (zmq.MAXMSGSIZE, MAX_REQUEST_BYTES), (zmq.RCVHWM, ROUTER_RCVHWM),
                              (zmq.SNDHWM, ROUTER_SNDHWM), (zmq.ROUTER_MANDATORY, 1)):
            self._router.setsockopt(option, value)
        self._guard = ConnectionGuard(self._router, self.settings.connection_limits, self._admins,
                                      lambda uid, gid, groups: self.allowlist.admits(uid, gid, groups))
        self._guard.start()
        self._router.bind(endpoint(self.socket_path))
        secure_socket(self.socket_path, self.socket_gid)
        self._fd_channel = FdChannelServer(fd_socket_path(self.socket_path), self.socket_gid, self._member_fds,
                                           self._fd_room, self._fd_dropped)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        if self.settings.metrics_port:
            self.metrics = Metrics(self.settings.metrics_port, self.registry, self.backend.usage,
                                   [d["uuid"] for d in self.backend.devices()])
        log.info(
            "peerd %s serving %s with the %s backend (pid %d); allowed: %s",
            __version__, self.socket_path, self.backend.name, os.getpid(), self.allowlist.describe(),
        )
        self._notifier.ready(self._summary())

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._signals.append(signum)  # handled by the loop, between two messages

    def serve(self) -> None:
        """Serve until SIGTERM or SIGINT, drain, then free everything and remove the socket."""
        handled = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
        previous = {s: signal.signal(s, self._on_signal) for s in handled}  # before bind announces readiness
        try:
            self.bind()
        except BaseException:
            for s, handler in previous.items():
                signal.signal(s, handler)
            try:
                if hasattr(self, "_router"):  # closed first: libzmq would unlink the path again at its exit
                    self._router.close(linger=0)
                self._remove_socket()  # bound, perhaps: no client may wait on a socket nobody will serve
            except Exception:  # the bind's own error is the one to tell
                log.exception("removing the socket after a failed start failed")
            raise
        old_wakeup = signal.set_wakeup_fd(self._wake_w.fileno())
        if self._signals:  # came while binding: the loop's first wait must not sleep through them
            self._wake_loop()
        try:
            self._loop()
        finally:
            signal.set_wakeup_fd(old_wakeup)  # the wake-up pipe closes in shutdown
            for s in handled:  # a signal now would cut the cleanup short and leave the socket behind; the
                signal.signal(s, self._on_signal_while_stopping)  # process ends after serve(), so they stay
            self.shutdown()

    @staticmethod
    def _on_signal_while_stopping(signum: int, _frame: Any) -> None:
        log.info("%s: already stopping: every buffer is freed, then the socket is removed (SIGKILL stops at once, "
                 "leaving the socket for the next daemon to replace)", signal.Signals(signum).name)

    def _handle_signals(self, now: float) -> Outbox:
        out: Outbox = []
        signals, self._signals = self._signals, []
        for signum in signals:
            if signum == signal.SIGHUP:
                self._reload()
            elif self._drain_until is None:
                grace = self.settings.shutdown_grace
                self._drain_until = now + grace
                log.info("%s: draining: no new joins; waiting up to %gs for live groups to be released "
                         "(send SIGINT or SIGTERM again, e.g. a second Ctrl-C, to stop at once)",
                         signal.Signals(signum).name, grace)
                self._notifier.stopping(f"draining: {self._summary()}")
                stopping = (f"the peerd daemon is stopping: release this group's buffers within {grace:g}s, "
                            "when it frees them")
                out += self.registry.drain(stopping)
                self.pages.draining(stopping)
            else:
                log.info("%s again: stopping now", signal.Signals(signum).name)
                self._stopping = True
        return out

    def _reload(self) -> None:
        """SIGHUP: read the settings again, on a thread (peerd.reloader); ``_apply_reload`` takes them."""
        if self._loader is None:
            log.warning("SIGHUP ignored: this daemon was not started with reloadable settings")
            return
        if self._reloader.request():
            self._notifier.reloading()

    def _read_settings(self) -> tuple[Settings, Allowlist]:
        """The reload thread's work: the file read, and its group names looked up."""
        fresh, _ = self._loader.load()
        _, allowed_gids = resolve_groups(fresh.socket_group, fresh.allow_gid)  # a file naming no group fails whole
        return fresh, Allowlist.build(fresh.allow_uid, allowed_gids, self.socket_gid)

    def _apply_reload(self, read: tuple[Settings, Allowlist] | None, error: Exception | None) -> None:
        """On the loop: apply the allowlist, log level, limits and timeouts a reload read.

        The socket, its group and mode, the backend and the metrics port stay
        as they are until a restart (the log says which changed). A bad file
        changes nothing: a serving daemon keeps what it runs with.
        """
        if error is not None:
            log.error("SIGHUP: configuration not reloaded, keeping the running one: %s", error)
            self._reload_failed = f"the last reload failed, the running configuration is kept: {error}"
        else:
            self._reload_failed = None
            fresh, self.allowlist = read
            logging.getLogger().setLevel(fresh.log_level.upper())
            self.registry.configure(fresh.limits, fresh.rendezvous_timeout, fresh.agreement_timeout)
            ignored = self._restart_pending = [f for f in RESTART_ONLY
                                               if getattr(fresh, f) != getattr(self.settings, f)]
            self.settings = replace(fresh, **{f: getattr(self.settings, f) for f in RESTART_ONLY})
            self._guard.limits = self.settings.connection_limits
            self._watcher.max_per_uid = self.settings.max_processes_per_uid
            self._fit_to_fd_limit()
            self._refused.clear()
            log.warning("SIGHUP: reloaded; allowed: %s; log level %s%s", self.allowlist.describe(), fresh.log_level,
                        f"; changed but needing a restart: {', '.join(ignored)}" if ignored else "")
        if not self._reloader.busy:  # systemd hears READY=1 once the last SIGHUP's read is applied
            self._notifier.reloaded(self._summary())

    def _fit_to_fd_limit(self) -> None:
        """Size the fd room to what --max-connections leaves of the fd limit, at start and on every reload,
        and warn where the limit cannot carry that many connections."""
        self._fd_room.size = room_within(self._fd_limit, self.settings.max_connections)
        unsafe = self.settings.connection_limits.unsafe_under(self._fd_limit)
        if unsafe:
            log.warning("%s", unsafe)

    def _wake_loop(self) -> None:
        with contextlib.suppress(OSError):  # full, or closed at shutdown: the loop wakes or is gone anyway
            self._wake_w.send(b"r")

    def _summary(self) -> str:
        """The STATUS systemd shows; a reload that failed stays in it until one succeeds (`systemctl reload`
        cannot fail: the daemon's READY=1 ends it either way)."""
        sets, held = self.registry.set_count(), self.registry.ranks_holding()
        summary = f"serving {self.socket_path} ({self.backend.name}): {sets} buffer set(s), {held} rank(s) held"
        return summary if self._reload_failed is None else f"{summary}; {self._reload_failed}"

    def shutdown(self) -> None:
        log.info("shutting down: failing waiters and freeing every buffer")
        for bset in self.registry.all_sets():
            holders = ", ".join(f"rank {s.rank} (pid {s.pid})" for s in bset.holding_slots())
            if holders:
                log.warning("%s is still held by %s: freeing it anyway; kernels of those processes may "
                            "still touch its memory", bset.label, holders)
        self._notifier.stopping("stopping: freeing every buffer")
        try:
            self.backend.stopping()  # what live workers still map stays as it is
            self.pages.shutdown()  # every group's abort word, before its memory goes
            self._deliver(self.registry.shutdown())
            if self.metrics is not None:
                self.metrics.close()
            self._notifier.close()
            self.backend.close()
            self._watcher.close()
            self._router.close(linger=SHUTDOWN_LINGER_MS)  # the last replies (SHUTTING_DOWN) still go out
            self._ctx.term()
            self._guard.join()
            self._wake_r.close()
            self._wake_w.close()
        finally:  # whatever failed above: no socket is left for clients to wait on, the lock goes
            self._remove_socket()
        log.info("stopped")

    def _remove_socket(self) -> None:
        """The socket and the fd channel's beside it (whatever of them bind made: the claim makes both
        paths this daemon's), then the claim."""
        try:
            if self._fd_channel is not None:
                self._fd_channel.close()
        finally:
            try:
                for path in (self.socket_path, fd_socket_path(self.socket_path)):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
            finally:
                self._claim.release()

    # ------------------------------------------------------------ the loop

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        if self.backend.ready_fd is not None:
            poller.register(self.backend.ready_fd, zmq.POLLIN)
        self._fd_channel.attach(poller)
        self._poller = poller
        while not self._stopping:
            events = dict(poller.poll(self._poll_timeout_ms()))
            try:
                self._turn(events)
            except Exception:  # a bug or a failing driver must cost one event, never the daemon
                log.exception("the daemon loop hit an error; serving on")

    def _turn(self, events: dict) -> None:
        """One pass of the loop: signals, messages, deaths, timers, then the replies."""
        poller = self._poller
        now = time.monotonic()
        out: Outbox = []
        if self._wake_r.fileno() in events:  # zmq reports plain sockets by fd
            self._wake_r.recv(4096)
            out += self._handle_signals(now)
        for read, error in self._reloader.finished():
            self._apply_reload(read, error)
        if self._router in events:
            self._read_router()
        readable = [fd for fd in events if isinstance(fd, int) and fd in self._watcher.fds]
        for fd in readable:
            poller.unregister(fd)
        for pid in [self._watcher.died(fd) for fd in readable] + self._watcher.sweep():
            out += self.registry.process_died(pid, now)
            self.backend.process_gone(pid)
            self.pages.process_gone(pid)
        if self.backend.ready_fd is not None and self.backend.ready_fd in events:
            out += self.registry.memory_ready(now, self.backend.woken())
        out += self.registry.expire(time.monotonic())
        self._deliver(out)
        for tally in self._tallies:
            tally.flush()
        self._fd_channel.serve(events, now)
        if now >= self._next_tick:
            self._tick(now)
        if self._drain_until is not None and (now >= self._drain_until or not self.registry.sets_held()):
            self._stopping = True

    def _tick(self, now: float) -> None:
        """Once a second, or each watchdog interval: ping systemd, refresh STATUS=."""
        interval = self._notifier.watchdog_interval
        self._next_tick = now + min(TICK_S, interval or TICK_S)
        if interval is not None:
            self._notifier.watchdog()
        if self._notifier.active:
            self._notifier.status(("draining: " if self._drain_until else "") + self._summary())

    def _poll_timeout_ms(self) -> int | None:
        deadlines = [d for d in (self.registry.next_deadline(), self._fd_channel.next_deadline(),
                                 *(t.due() for t in self._tallies)) if d is not None]
        waits = [max(0.0, min(deadlines) - time.monotonic())] if deadlines else []
        if self._watcher.polling:
            waits.append(POLL_INTERVAL)
        if self._notifier.active:
            waits.append(max(0.0, self._next_tick - time.monotonic()))
        if self._drain_until is not None:
            waits.append(max(0.0, self._drain_until - time.monotonic()))
        return None if not waits else int(min(waits) * 1000) + 1

    def _read_router(self) -> None:
        """Serve queued requests, each reply sent at once: one poll serves a burst, and a flood
        can neither hold replies back nor keep the loop from timers, deaths and signals."""
        turn_ends = time.monotonic() + TURN_S
        for _ in range(MESSAGES_PER_TURN):
            if self._oversized and not self._drop_oversized(turn_ends):
                return
            try:
                frames = [self._router.recv(zmq.NOBLOCK, copy=False)]
                while frames[-1].more and len(frames) < 3:  # a message's frames are all there once its first is
                    frames.append(self._router.recv(zmq.NOBLOCK, copy=False))
            except zmq.Again:
                return
            self._oversized = frames[-1].more
            self._deliver(self._handle(frames))
            if time.monotonic() >= turn_ends:
                return

    def _drop_oversized(self, turn_ends: float) -> bool:
        """Drop the rest of a message of more frames than a request has, over as many turns as it takes:
        whether it ended in this one."""
        while time.monotonic() < turn_ends:
            for _ in range(DROP_FRAMES_PER_LOOK):
                try:
                    more = self._router.recv(zmq.NOBLOCK, copy=False).more
                except zmq.Again:
                    more = False
                if not more:
                    self._oversized = False
                    self._trim_heap()
                    return True
        return False

    def _trim_heap(self) -> None:
        """Give the heap that libzmq's I/O thread filled with a dropped message's frames back to the system
        (it kept hundreds of MB after one), at most once per TRIM_EVERY_S whatever a client sends."""
        now = time.monotonic()
        if _malloc_trim is not None and now >= self._next_trim:
            self._next_trim = now + TRIM_EVERY_S
            _malloc_trim(0)

    def _handle(self, frames: list[zmq.Frame]) -> Outbox:
        if len(frames) != 2:
            log.debug("dropped a message of %d frames", len(frames))
            self._malformed.add("not identity + one payload (dropped)")  # the count is the sender's to vary
            return []
        identity, payload = frames[0].bytes, frames[1]
        if not self_named(identity):  # a reply to a name another user can take may go astray: Note [Routing ids]
            self._malformed.add("a routing id libzmq made up or too short to be unguessable")
            return [Send(Route(identity, None), error=ProtocolError(ErrorCode.BAD_REQUEST, UNNAMED))]
        who = credentials(payload)
        if who is None:
            self._malformed.add("no kernel credentials, not an ipc peer? (dropped)")
            return []
        read: list[frozenset[int] | None] = []

        def groups() -> frozenset[int] | None:
            """Supplementary groups as the kernel recorded them on this connection, read only when needed."""
            read.append(connection_groups(payload, who))
            return read[0]

        allowed = self.allowlist.admits(who.uid, who.gid, groups)
        if not allowed:  # refused before its frame is decoded
            return self._refuse(identity, who, payload.bytes, groups_unknown=read == [None])
        try:
            request = decode_request(payload.bytes)
        except ProtocolError as err:
            log.debug("pid %d sent a bad request: %s", who.pid, err)
            self._malformed.add(f"uid {who.uid}: {err.code.value}")
            return [Send(Route(identity, err.request_id), error=err)]
        caller = Route(identity, request.id, request.op, time.monotonic())
        refusal = admit(OPS[request.op], who, allowed, self._drain_until is not None, self._admins)
        if refusal is not None:
            return [Send(caller, error=refusal)]
        try:
            return self._handlers[request.op](caller, who, request.body)
        except Exception as err:  # a bug must cost one request, never the daemon
            log.exception("op %s from pid %d failed", request.op, who.pid)
            return [Send(caller, error=ProtocolError(ErrorCode.INTERNAL, f"{type(err).__name__}: {err}"))]

    def _deliver(self, out: Outbox) -> None:
        packed: dict[int, bytes] = {}  # id(body) -> its bytes: a body answering several callers is packed once
        for send in out:
            if self.metrics is not None:
                self.metrics.answered(send)
            identity, request_id, op = send.caller[:3]
            if send.error is not None:
                if op is not None and not OPS[op].answers(send.error.code):
                    log.error("bug: %s answered %s, which its record in peerd/ops.py does not declare",
                              op, send.error.code.value)
                frame = encode_error(request_id, send.error.code, send.error.message)
            else:
                body = packed.get(id(send.body))
                if body is None:
                    body = packed[id(send.body)] = pack_body(send.body)
                frame = encode_packed_reply(request_id, body)
            try:
                self._send(identity, frame)
            except zmq.Again:
                self._dropped.add(f"the client's queue is full ({ROUTER_SNDHWM} replies): it does not read them, "
                                  f"or has over {CLIENT_WINDOW} requests in flight")
            except zmq.ZMQError:  # EHOSTUNREACH
                self._dropped.add("the client disconnected before its reply")

    def _send(self, identity: bytes, frame: bytes) -> None:
        """Send now, or raise zmq.Again where the connection's queue is full: Note [Reply window]."""
        try:
            self._router.send_multipart([identity, frame], zmq.NOBLOCK)
        except zmq.Again:
            self._router.getsockopt(zmq.EVENTS)  # takes in every read count the I/O thread reported
            self._router.send_multipart([identity, frame], zmq.NOBLOCK)

    # ------------------------------------------------------------ handlers

    def _refuse(self, identity: bytes, who: Credentials, frame: bytes, groups_unknown: bool) -> Outbox:
        """A caller outside the allowlist: a coded refusal, nothing else; logged once per connection. Where
        its supplementary groups could not be read, the log says so: most often its connection was shut
        down over a cap before its message was read, and the caller may well be allowed."""
        if identity not in self._refused:
            if len(self._refused) > 10_000:
                self._refused.clear()
            self._refused.add(identity)
            why = ("its uid and primary group are not allowed and its supplementary groups could not be read "
                   "(its connection closed first, e.g. shut down over a cap)" if groups_unknown else
                   "not in the allowlist")
            self._outsiders.add(f"uid {who.uid}, gid {who.gid}",
                                f"refused pid {who.pid} (uid {who.uid}, gid {who.gid}): {why}")
        try:
            request_id = request_id_of(msgpack.unpackb(frame)) if len(frame) <= 4096 else None
        except Exception:  # whatever it sent, the answer is the same
            request_id = None
        return [Send(Route(identity, request_id), error=forbidden(who))]

    def _member_fds(self, who: Credentials, groups: GroupSource, request: Any) -> tuple[list[bytes], list[int]]:
        return member_fds(self.registry, self.backend, self.pages, self.allowlist, who, groups, request)

    def _handler(self, op: Op) -> Handler:
        """The op's handler, as its record says: Registry.<name> (the caller's uid picks its key namespace),
        after watching the caller's pid where the op may leave it holding or waiting on something, so its
        death is seen; else the daemon's own _serve_<name>."""
        if not op.registry:
            return getattr(self, f"_serve_{op.name}")
        method = getattr(self.registry, op.name)

        def handle(caller: Route, who: Credentials, body: dict) -> Outbox:
            if op.watches:
                if who.pid <= 0:  # the kernel's pid for a process outside the daemon's pid namespace
                    return [Send(caller, error=ProtocolError(ErrorCode.FORBIDDEN, unseen(op.name)))]
                refusal = self._watcher.refusal(who.pid, who.uid)
                if refusal:
                    return [Send(caller, error=ProtocolError(ErrorCode.LIMIT_EXCEEDED, refusal))]
                try:
                    fd = self._watcher.watch(who.pid, who.uid)
                except OSError as err:
                    message = f"the daemon cannot watch pid {who.pid} for its death now ({err.strerror}): try again"
                    return [Send(caller, error=ProtocolError(ErrorCode.LIMIT_EXCEEDED, message))]
                if fd is not None:
                    self._poller.register(fd, zmq.POLLIN)
            return method(caller, who, body, time.monotonic())

        return handle

    def _serve_evict(self, caller: Route, who: Credentials, body: dict) -> Outbox:
        """Free a stuck group by force, in every uid's namespace unless one is named (admins only: see peerd.ops)."""
        log.warning("pid %d (uid %d) evicts group=%s name=%s of uid %s", who.pid, who.uid, body["group"],
                    body["name"] or "*", "*" if body["uid"] is None else body["uid"])
        out, evicted = self.registry.evict(body["group"], body["name"], body["uid"])
        self.backend.trim()
        return out + [Send(caller, {"evicted": evicted})]

    def _serve_ls(self, caller: Route, who: Credentials, body: dict) -> Outbox:
        """One page of the caller's buffer sets after its cursor (peerd.paging)."""
        shown, more = self.registry.listing(time.monotonic(), who.uid, body["after"], body["limit"])
        return [Send(caller, {"groups": shown, "more": more})]

    def _serve_hello(self, caller: Route, who: Credentials, body: dict) -> Outbox:
        return [Send(caller, report.hello(self.registry, self.backend, self.pages.instance))]

    def _serve_status(self, caller: Route, who: Credentials, body: dict) -> Outbox:
        loop = {
            "draining": self._drain_until is not None,
            "allowed": {"uids": sorted(self.allowlist.uids), "gids": sorted(self.allowlist.gids)},
            "socket": self.socket_path,
            "uptime_s": round(time.monotonic() - self.started, 3),
            "clients_watched": len(self._watcher.fds),
            "fd_room": {"size": self._fd_room.size, "used": self._fd_room.used},
            "liveness": "polling" if self._watcher.polling else "pidfd",
            "connections": self._guard.snapshot(),
            "replies_dropped": self._dropped.total,
            "reload_failed": self._reload_failed,
            "restart_pending": self._restart_pending,
            "metrics_unserved": self.metrics.unserved if self.metrics is not None else None,
        }
        stuck = self._stuck.scan(self.registry, time.monotonic())
        return [Send(caller, report.status(self.registry, self.backend, self.pages.instance, who.uid, loop, stuck))]

    def _allocate(self, nbytes: int, device: str, flags: int, uid: int | None) -> Allocation:
        """The registry's allocate."""
        try:
            return self.backend.allocate(nbytes, device, flags, uid)
        except Exception as err:  # a try, not a context manager: this runs once per join
            raise _as_error_code(err, f"allocating {nbytes} bytes on {device}") from err

    def _ready(self, allocation: Allocation) -> bool:
        """The registry's ready."""
        try:
            return self.backend.ready(allocation)
        except Exception as err:
            raise _as_error_code(err, f"reserving {allocation.size} bytes on {allocation.device}") from err


#: the backend failures whose own message is the whole story, and the code each becomes
_KNOWN_FAILURES = ((UnknownDevice, ErrorCode.DEVICE_UNKNOWN), (OverCap, ErrorCode.LIMIT_EXCEEDED),
                   (AllocationFailed, ErrorCode.ALLOCATION_FAILED))


def _as_error_code(err: Exception, doing: str) -> ProtocolError:
    """The one place where a backend's failure becomes an error code."""
    for kind, code in _KNOWN_FAILURES:
        if isinstance(err, kind):
            return ProtocolError(code, str(err))
    return ProtocolError(ErrorCode.ALLOCATION_FAILED, f"{doing} failed: {err}")
