"""The daemon's loop: a ZeroMQ ROUTER in front of the group registry.

One thread does everything, so the registry needs no locks: receive a frame,
read the caller's kernel credentials off it, hand the request to the
registry, deliver the replies it owes, fire due timers, and turn client-pid
deaths into registry events. Signals arrive through a wakeup pipe polled like
any socket, so SIGTERM is handled between two messages, never inside one.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable

import msgpack
import zmq

from . import __version__
from .access import Allowlist, prepare_socket_dir, resolve_group, secure_socket
from .backends import MemoryBackend
from .groups import Allocation, Outbox, Registry, Send
from .liveness import POLL_INTERVAL, PidWatcher
from .lockfile import SocketLock
from .paths import endpoint, lock_path
from .protocol import (
    VERSION,
    ErrorCode,
    ProtocolError,
    decode_request,
    encode_error,
    encode_reply,
    request_id_of,
)
from .settings import Settings

log = logging.getLogger("peerd.server")


@dataclass(frozen=True)
class Credentials:
    uid: int
    gid: int
    pid: int


def credentials(frame: zmq.Frame) -> Credentials | None:
    """The sender's uid, gid and pid, as the kernel reported them (SO_PEERCRED).

    libzmq sets Peer-Address to "...:uid:gid:pid" on frames of ipc connections;
    nothing a client writes in its message is ever trusted for this.
    """
    try:
        address = frame.get("Peer-Address")
        uid, gid, pid = (int(part) for part in address.rsplit(":", 3)[1:])
    except (zmq.ZMQError, ValueError, AttributeError):
        return None
    return Credentials(uid, gid, pid)


class Daemon:
    def __init__(self, settings: Settings, backend: MemoryBackend):
        self.settings = settings
        self.socket_path = settings.socket
        self.backend = backend
        self.registry = Registry(
            self._allocate, backend.free, settings.rendezvous_timeout, settings.agreement_timeout, settings.limits
        )
        self.socket_gid = resolve_group(settings.socket_group) if settings.socket_group is not None else None
        self.allowlist = Allowlist.build(
            settings.allow_uid, tuple(resolve_group(g) for g in settings.allow_gid), self.socket_gid
        )
        self.started = time.monotonic()
        self._lock = SocketLock(lock_path(self.socket_path))
        self._watcher = PidWatcher()
        self._stopping = False
        self._refused: set[bytes] = set()  # connections already logged as refused
        self._handlers: dict[str, Callable[[Any, Credentials, dict], Outbox]] = {
            "join": self._stateful(self.registry.join, owned=True),
            "commit": self._stateful(self.registry.commit),
            "release": self._stateful(self.registry.release),
            "agree": self._stateful(self.registry.agree, owned=True),
            "evict": self._evict,
            "hello": self._immediate(self._hello),
            "status": self._immediate(self._status),
            "ls": self._immediate(lambda: {"groups": self.registry.listing(time.monotonic())}),
        }

    # ------------------------------------------------------------ lifecycle

    def bind(self) -> None:
        """Take the lock, then the socket: refuse rather than steal a live daemon's."""
        prepare_socket_dir(os.path.dirname(self.socket_path), self.settings.socket_dir_mode, self.socket_gid)
        self._lock.acquire()
        if os.path.exists(self.socket_path):
            log.warning("removing stale socket %s left by a daemon that is gone", self.socket_path)
            os.unlink(self.socket_path)
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, self.settings.max_message_bytes)
        self._router.bind(endpoint(self.socket_path))
        secure_socket(self.socket_path, self.socket_gid)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        log.info(
            "peerd %s serving %s with the %s backend (pid %d); allowed: %s",
            __version__, self.socket_path, self.backend.name, os.getpid(), self.allowlist.describe(),
        )

    def request_stop(self, *_: Any) -> None:
        self._stopping = True

    def serve(self) -> None:
        """Serve until SIGTERM or SIGINT, then free everything and remove the socket."""
        self.bind()
        previous = {s: signal.signal(s, self.request_stop) for s in (signal.SIGTERM, signal.SIGINT)}
        old_wakeup = signal.set_wakeup_fd(self._wake_w.fileno())
        try:
            self._loop()
        finally:
            signal.set_wakeup_fd(old_wakeup)
            for s, handler in previous.items():
                signal.signal(s, handler)
            self.shutdown()

    def shutdown(self) -> None:
        log.info("shutting down: failing waiters and freeing every buffer")
        self._deliver(self.registry.shutdown())
        self.backend.close()
        self._watcher.close()
        self._router.close(linger=0)
        self._ctx.term()
        self._wake_r.close()
        self._wake_w.close()
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)
        self._lock.release()
        log.info("stopped")

    # ------------------------------------------------------------ the loop

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        self._poller = poller
        while not self._stopping:
            events = dict(poller.poll(self._poll_timeout_ms()))
            now = time.monotonic()
            out: Outbox = []
            if self._router in events:
                out += self._drain_router()
            if self._wake_r in events:
                self._wake_r.recv(4096)
            for fd in [fd for fd in events if isinstance(fd, int) and fd in self._watcher.fds]:
                poller.unregister(fd)
                out += self.registry.process_died(self._watcher.died(fd), now)
            for pid in self._watcher.sweep():
                out += self.registry.process_died(pid, now)
            out += self.registry.expire(time.monotonic())
            self._deliver(out)

    def _poll_timeout_ms(self) -> int | None:
        deadline = self.registry.next_deadline()
        waits = [] if deadline is None else [max(0.0, deadline - time.monotonic())]
        if self._watcher.polling:
            waits.append(POLL_INTERVAL)
        return None if not waits else int(min(waits) * 1000) + 1

    def _drain_router(self) -> Outbox:
        """Handle every frame already queued, so one poll serves a burst."""
        out: Outbox = []
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return out
            out += self._handle(frames)

    def _handle(self, frames: list[zmq.Frame]) -> Outbox:
        if len(frames) != 2:
            log.warning("dropped a message of %d frames (expected identity + one payload)", len(frames))
            return []
        identity, payload = frames[0].bytes, frames[1]
        who = credentials(payload)
        if who is None:
            log.warning("dropped a message without kernel credentials (not an ipc peer?)")
            return []
        if not self.allowlist.allows(who.uid, who.gid, who.pid):
            return self._refuse(identity, who, payload.bytes)
        try:
            request = decode_request(payload.bytes, self.settings.max_message_bytes)
        except ProtocolError as err:
            log.warning("pid %d sent a bad request: %s", who.pid, err)
            return [Send((identity, err.request_id), error=err)]
        caller = (identity, request.id)
        try:
            return self._handlers[request.op](caller, who, request.body)
        except Exception as err:  # a bug must cost one request, never the daemon
            log.exception("op %s from pid %d failed", request.op, who.pid)
            return [Send(caller, error=ProtocolError(ErrorCode.INTERNAL, f"{type(err).__name__}: {err}"))]

    def _deliver(self, out: Outbox) -> None:
        for send in out:
            identity, request_id = send.caller
            if send.error is not None:
                frame = encode_error(request_id, send.error.code, send.error.message)
            else:
                frame = encode_reply(request_id, send.body)
            try:
                self._router.send_multipart([identity, frame], zmq.NOBLOCK)
            except zmq.ZMQError as err:  # the caller is gone or its queue is full
                log.warning("could not deliver a reply to request %s: %s", request_id, err)

    # ------------------------------------------------------------ handlers

    def _refuse(self, identity: bytes, who: Credentials, frame: bytes) -> Outbox:
        """A caller outside the allowlist: a coded refusal, nothing else; logged once per connection."""
        if identity not in self._refused:
            if len(self._refused) > 10_000:
                self._refused.clear()
            self._refused.add(identity)
            log.warning("refused pid %d (uid %d, gid %d): not in the allowlist", who.pid, who.uid, who.gid)
        try:
            request_id = request_id_of(msgpack.unpackb(frame)) if len(frame) <= 4096 else None
        except Exception:  # whatever it sent, the answer is the same
            request_id = None
        error = ProtocolError(
            ErrorCode.FORBIDDEN,
            f"uid {who.uid} (gid {who.gid}) may not use this peerd; the operator can allow it "
            "with --allow-uid or --allow-gid",
        )
        return [Send((identity, request_id), error=error)]

    def _stateful(self, method: Callable[..., Outbox], owned: bool = False) -> Callable[[Any, Credentials, dict], Outbox]:
        """A registry op: watch the caller's pid first, so its death is seen.

        ``owned`` ops create groups, which belong to the caller's uid.
        """

        def handle(caller: Any, who: Credentials, body: dict) -> Outbox:
            fd = self._watcher.watch(who.pid)
            if fd is not None:
                self._poller.register(fd, zmq.POLLIN)
            if owned:
                return method(caller, who.pid, body, time.monotonic(), uid=who.uid)
            return method(caller, who.pid, body, time.monotonic())

        return handle

    def _evict(self, caller: Any, who: Credentials, body: dict) -> Outbox:
        """Free a stuck group by force: root or the daemon's own uid only."""
        if who.uid not in (0, os.geteuid()):
            return [Send(caller, error=ProtocolError(
                ErrorCode.FORBIDDEN, f"only root or uid {os.geteuid()} may evict; uid {who.uid} may not"))]
        log.warning("pid %d (uid %d) evicts group=%s name=%s", who.pid, who.uid, body["group"], body["name"] or "*")
        out, evicted = self.registry.evict(body["group"], body["name"])
        return out + [Send(caller, {"evicted": evicted})]

    @staticmethod
    def _immediate(build: Callable[[], dict]) -> Callable[[Any, Credentials, dict], Outbox]:
        return lambda caller, who, body: [Send(caller, build())]

    def _allocate(self, nbytes: int, device: str, flags: int, uid: int | None) -> Allocation:
        try:
            return self.backend.allocate(nbytes, device, flags, uid)
        except ProtocolError:
            raise
        except Exception as err:
            raise ProtocolError(
                ErrorCode.ALLOCATION_FAILED, f"allocating {nbytes} bytes on {device} failed: {err}"
            ) from err

    def _hello(self) -> dict:
        return {
            "version": __version__,
            "protocol": VERSION,
            "pid": os.getpid(),
            "backend": self.backend.name,
            "rendezvous_timeout": self.registry.rendezvous_timeout,
            "agreement_timeout": self.registry.agreement_timeout,
        }

    def _status(self) -> dict:
        sets = self.registry.all_sets()
        return {
            **self._hello(),
            "socket": self.socket_path,
            "uptime_s": round(time.monotonic() - self.started, 3),
            "devices": self.backend.devices(),
            "groups": len(sets),
            "ranks_held": sum(len(b.holders()) for b in sets),
            "bytes_allocated": sum(s.allocation.size for b in sets for s in b.slots.values() if s.allocation),
            "agreements_pending": len(self.registry.agreements),
            "clients_watched": len(self._watcher.fds),
            "liveness": "polling" if self._watcher.polling else "pidfd",
        }
