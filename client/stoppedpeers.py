"""A peer stopped past a grace aborts its group's control page, so nobody waits on it for ever.

A stopped process (SIGSTOP, Ctrl-Z of one rank, a debugger's breakpoint)
is alive: no pidfd fires, the daemon aborts nothing, and a peer's kernel
polling the abort word, or an all-reduce given no deadline, waits for it as
long as it stays stopped. So a process holding a set with a control page
looks at its peers once a second (``/proc/PID/stat``: the peers run as its
own user, while the daemon's sandbox, ProtectProc=invisible, hides other
users' processes from it) and, where one has been seen stopped the whole
time for ``PEERD_STOPPED_ABORT_S`` seconds (20; raise it while debugging a
rank), aborts the page (MEMBER_STOPPED) naming it: the peers' kernels,
rounds and ``check()`` end with that reason.

A whole job stopped at once (Ctrl-Z of ``peerd run``) aborts nothing: its
watchers stop too, and a watcher that was itself held up longer than a few
polls starts counting afresh. The peers' pids come in the join reply, as
the daemon saw them; a process that does not find its own pid there runs in
another pid namespace than the daemon, where those pids name other
processes, and does not watch.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from peerd.controlpage import AbortCode

from .connection import seconds_from_env

log = logging.getLogger("peerd_client")

STOPPED_ABORT_S = seconds_from_env("PEERD_STOPPED_ABORT_S", 20.0)
POLL_S = 1.0
#: a gap between two polls longer than this: the watcher itself was held up (stopped, starved), so what it
#: saw before says nothing about the time between
STALE_AFTER_S = 3 * POLL_S


class StopClock:
    """How long each pid has been seen stopped without a break, from polls ``POLL_S`` apart."""

    def __init__(self) -> None:
        self._since: dict[int, float] = {}
        self._last: float | None = None

    def poll(self, now: float) -> None:
        """A new poll starts; after a gap, every count starts afresh."""
        if self._last is not None and now - self._last > STALE_AFTER_S:
            self._since.clear()
        self._last = now

    def seen(self, pid: int, stopped: bool, now: float) -> float:
        """Record one observation; the seconds ``pid`` has been stopped since first seen so (0 if running)."""
        if not stopped:
            self._since.pop(pid, None)
            return 0.0
        return now - self._since.setdefault(pid, now)

    def keep(self, pids: set[int]) -> None:
        """Forget pids no longer watched."""
        for pid in set(self._since) - pids:
            del self._since[pid]


def stopped(pid: int) -> bool:
    """Whether ``pid``, a process of this user, is stopped (state T) or stopped by a tracer (t)."""
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.geteuid():  # not a peer: the pid was reused by another user
            return False
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:  # gone: the daemon reports a death itself
        return False
    state = stat.rsplit(b")", 1)[-1].split()[:1]
    return state in ([b"T"], [b"t"])


class StoppedPeers:
    """The links of this process whose pages a stopped peer would hang, and the thread that watches them."""

    def __init__(self, grace: float = STOPPED_ABORT_S) -> None:
        self.grace = grace
        self._lock = threading.Lock()
        self._links: dict[object, list[int]] = {}  # GroupLink -> its peers' pids, by rank (its own rank: 0)
        self._thread: threading.Thread | None = None

    def watch(self, link, pids: list[int] | None) -> None:
        """Watch ``link``'s peers, where the daemon named their pids in this process's pid namespace."""
        if link.page is None or not pids or len(pids) != link.npes or pids[link.rank] != os.getpid():
            return
        peers = [0 if rank == link.rank else pid for rank, pid in enumerate(pids)]
        with self._lock:
            self._links[link] = peers
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="peerd-stopped-peers", daemon=True)
                self._thread.start()

    def discard(self, link) -> None:
        with self._lock:
            self._links.pop(link, None)

    def forget(self) -> None:
        """A forked child: its parent's links and thread are not its own."""
        self._links = {}
        self._lock = threading.Lock()
        self._thread = None

    def _run(self) -> None:
        clock = StopClock()
        while True:
            time.sleep(POLL_S)
            with self._lock:
                if not self._links:
                    self._thread = None  # the next watch starts another
                    return
                links = list(self._links.items())
            now = time.monotonic()
            clock.poll(now)
            pids = {pid for _, peers in links for pid in peers if pid}
            clock.keep(pids)
            # each peer read once a poll, however many of this process's sets it shares
            stopped_for = {pid: clock.seen(pid, stopped(pid), now) for pid in pids}
            for link, peers in links:
                self._check(link, peers, stopped_for)

    def _check(self, link, peers: list[int], stopped_for: dict[int, float]) -> None:
        page = link.page
        if page is None or page.aborted() is not None:
            return
        for rank, pid in enumerate(peers):
            if pid and stopped_for[pid] >= self.grace:
                reason = (f"rank {rank} (pid {pid}), a peer of {link.label}, has been stopped (SIGSTOP, or a "
                          f"debugger) for {self.grace:g}s while its peers waited (PEERD_STOPPED_ABORT_S)")
                log.warning("%s: aborting the group", reason)
                page.abort(AbortCode.MEMBER_STOPPED, reason)
                self.discard(link)
                return


stopped_peers = StoppedPeers()
os.register_at_fork(after_in_child=stopped_peers.forget)
