"""Knowing at once when a client process dies.

Each client pid the daemon learned from the kernel gets a pidfd, which turns
readable when the process exits; the server polls these beside its socket,
so a death wakes the loop like a message would. Where pidfd_open is missing
(old kernels, some sandboxes) the watcher falls back to checking every pid
each POLL_INTERVAL seconds.
"""

from __future__ import annotations

import logging
import os
import time

log = logging.getLogger("peerd.liveness")

POLL_INTERVAL = 0.2


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class PidWatcher:
    def __init__(self) -> None:
        self.fds: dict[int, int] = {}  # pidfd -> pid
        self._pids: set[int] = set()
        self.polling = not hasattr(os, "pidfd_open")
        self._dead: list[int] = []
        self._next_poll = 0.0

    def watch(self, pid: int) -> int | None:
        """Start watching pid; the new pidfd to poll, if one was made."""
        if pid in self._pids:
            return None
        self._pids.add(pid)
        if self.polling:
            return None
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._dead.append(pid)
            return None
        except OSError as err:  # ENOSYS, EPERM under seccomp: fall back for good
            log.warning("pidfd_open unavailable (%s); checking client pids every %.1fs", err, POLL_INTERVAL)
            self.polling = True
            return None
        self.fds[fd] = pid
        return fd

    def died(self, fd: int) -> int:
        """The pid behind a readable pidfd, which is closed and forgotten."""
        pid = self.fds.pop(fd)
        os.close(fd)
        self._pids.discard(pid)
        return pid

    def sweep(self) -> list[int]:
        """Pids found dead without a pidfd (at watch time, or by polling)."""
        dead, self._dead = self._dead, []
        now = time.monotonic()
        if self.polling and now >= self._next_poll:  # not on every message: once per interval
            self._next_poll = now + POLL_INTERVAL
            dead += [pid for pid in self._pids - set(self.fds.values()) if not pid_alive(pid)]
        for pid in dead:
            self._pids.discard(pid)
        return dead

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()
        self._pids.clear()
