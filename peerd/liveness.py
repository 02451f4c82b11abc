"""Knowing at once when a client process dies.

Each client pid the daemon learned from the kernel gets a pidfd, which turns
readable when the process exits; the server polls these beside its socket,
so a death wakes the loop like a message would. Where pidfd_open is missing
(old kernels, some sandboxes) the watcher falls back to checking every pid
each POLL_INTERVAL seconds.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections import Counter

from .fdroom import FdRoom
from .trust import pid_alive

log = logging.getLogger("peerd.liveness")

POLL_INTERVAL = 0.2

#: live processes of one uid the daemon watches at most by default (--max-processes-per-uid): a
#: pidfd each, so a user starting processes that each join or vote once cannot spend the daemon's
#: fds (64 connections per uid by default: this leaves room for processes that closed theirs)
MAX_PIDS_PER_UID = 256


class PidWatcher:
    def __init__(self, max_per_uid: int = MAX_PIDS_PER_UID, room: FdRoom | None = None) -> None:
        self.fds: dict[int, int] = {}  # pidfd -> pid
        self.room = room or FdRoom()  # shared with the page areas: peerd.fdroom
        self._uid_of: dict[int, int | None] = {}  # every pid watched -> its uid
        self._per_uid: Counter[int | None] = Counter()
        self.max_per_uid = max_per_uid
        self.polling = not hasattr(os, "pidfd_open")
        self._dead: list[int] = []
        self._next_poll = 0.0

    def refusal(self, pid: int, uid: int | None) -> str | None:
        """Why ``pid`` may not be watched: its uid has ``max_per_uid`` live processes watched already, or the
        daemon has no fd left for a pidfd."""
        if pid in self._uid_of:
            return None
        if not self.polling and self.room.full:
            return self.room.describe()
        if self._per_uid[uid] < self.max_per_uid:
            return None
        return (f"uid {uid} already has {self._per_uid[uid]} live processes holding or waiting on something in the "
                f"daemon (at most {self.max_per_uid}, --max-processes-per-uid); pid {pid} is refused: try again "
                "once some of them exit")

    def watch(self, pid: int, uid: int | None) -> int | None:
        """Start watching pid (``refusal`` said yes); the new pidfd to poll, if one was made. OSError where
        the kernel has no fd or memory for one now: that pid is not watched, and pidfds stay on for all."""
        if pid in self._uid_of:
            return None
        self._uid_of[pid] = uid
        self._per_uid[uid] += 1
        if self.polling:
            return None
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._dead.append(pid)
            return None
        except OSError as err:
            if err.errno not in (errno.ENOSYS, errno.EPERM):  # EMFILE, ENFILE, ENOMEM: for now, and for this pid
                self._forget(pid)
                raise
            log.warning("pidfd_open unavailable (%s); checking client pids every %.1fs", err, POLL_INTERVAL)
            self.polling = True
            return None
        self.room.take()
        self.fds[fd] = pid
        return fd

    def died(self, fd: int) -> int:
        """The pid behind a readable pidfd, which is closed and forgotten."""
        pid = self.fds.pop(fd)
        os.close(fd)
        self.room.give()
        self._forget(pid)
        return pid

    def sweep(self) -> list[int]:
        """Pids found dead without a pidfd (at watch time, or by polling)."""
        dead, self._dead = self._dead, []
        now = time.monotonic()
        if self.polling and now >= self._next_poll:  # not on every message: once per interval
            self._next_poll = now + POLL_INTERVAL
            dead += [pid for pid in self._uid_of.keys() - set(self.fds.values()) if not pid_alive(pid)]
        for pid in dead:
            self._forget(pid)
        return dead

    def _forget(self, pid: int) -> None:
        uid = self._uid_of.pop(pid, None)
        self._per_uid[uid] -= 1
        if not self._per_uid[uid]:
            del self._per_uid[uid]

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
            self.room.give()
        self.fds.clear()
        self._uid_of.clear()
        self._per_uid.clear()
