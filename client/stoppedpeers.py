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
the daemon saw them, and as each peer claimed them in its own join (its pid
namespace and its pid there). A process that finds its own pid in the
daemon's list shares the daemon's pid namespace and watches those; one that
does not (a worker pod of its own, the daemon in the host's: docs/kubernetes.md)
watches the peers that claimed its own namespace, by their own pids, where
its /proc shows that namespace. A peer's claim is its word: it could name
any process, but only one of this user, which a peer of this user's group
could stop or abort the group anyway.
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


_own_claim: tuple[int, list | None] | None = None  # (the pid it was read in, the claim): read once per process


def own_pid() -> list | None:
    """[this process's pid namespace, its pid there], as a join claims them; None where /proc cannot say.
    Read once per process (a process never leaves its pid namespace), so no join waits on /proc."""
    global _own_claim
    mine = os.getpid()
    if _own_claim is None or _own_claim[0] != mine:  # a forked child has a pid, maybe a namespace, of its own
        try:
            claim = [os.readlink("/proc/self/ns/pid"), mine]
        except OSError:
            claim = None
        _own_claim = (mine, claim)
    return None if _own_claim[1] is None else list(_own_claim[1])


def peer_pids(rank: int, pids: list[int] | None, claims: list | None) -> list[int] | None:
    """Each peer's pid in this process's pid namespace (0: not known here, and this rank's own), or None:
    the daemon's pids where this process's own is among them, else the claims made in this process's
    namespace, where this process's /proc shows that namespace (a pid read there names the claimed one)."""
    if not pids or rank >= len(pids):
        return None
    mine = os.getpid()
    if pids[rank] == mine:
        return [0 if r == rank else pid for r, pid in enumerate(pids)]
    here = own_pid()
    if here is None or not claims or len(claims) != len(pids) or claims[rank] != here:
        return None
    try:
        if os.readlink("/proc/self") != str(mine):  # a /proc of another pid namespace
            return None
    except OSError:
        return None
    return [claim[1] if r != rank and claim is not None and claim[0] == here[0] else 0
            for r, claim in enumerate(claims)]


_STOPPED = (b"T", b"t")  # stopped, or stopped by a tracer


def _state(stat_path: str) -> bytes | None:
    """The state letter of a /proc stat file; None if it is gone."""
    try:
        with open(stat_path, "rb") as f:
            stat = f.read()
    except OSError:
        return None
    state = stat.rsplit(b")", 1)[-1].split()[:1]
    return state[0] if state else None


def stopped(pid: int) -> bool:
    """Whether ``pid``, a process of this user, is stopped (state T) or stopped by a tracer (t).

    /proc/PID/stat is the main thread's: once that thread has exited while others run on, it reads
    Z (zombie) for good, stopped or not. Then the process is stopped when every thread not yet
    exited is.
    """
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.geteuid():  # not a peer: the pid was reused by another user
            return False
    except OSError:  # gone: the daemon reports a death itself
        return False
    state = _state(f"/proc/{pid}/stat")
    if state != b"Z":
        return state in _STOPPED
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    live = [s for s in (_state(f"/proc/{pid}/task/{tid}/stat") for tid in threads) if s not in (None, b"Z", b"X")]
    return bool(live) and all(s in _STOPPED for s in live)


class StoppedPeers:
    """The links of this process whose pages a stopped peer would hang, and the thread that watches them."""

    def __init__(self, grace: float = STOPPED_ABORT_S) -> None:
        self.grace = grace
        self._lock = threading.Lock()
        self._links: dict[object, list[int]] = {}  # GroupLink -> its peers' pids, by rank (its own rank: 0)
        self._thread: threading.Thread | None = None

    def watch(self, link, pids: list[int] | None, claims: list | None = None) -> None:
        """Watch ``link``'s peers whose pids in this process's pid namespace are known (``peer_pids``)."""
        peers = peer_pids(link.rank, pids, claims) if link.page is not None else None
        if not peers or len(peers) != link.npes or not any(peers):
            return
        with self._lock:
            self._links[link] = peers
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="peerd-stopped-peers", daemon=True)
                self._thread.start()

    def discard(self, link) -> None:
        """Lock-free (one dict pop, atomic under the GIL): a garbage-collected PeerBuffer's finalizer comes
        here, on whichever thread allocated, maybe one holding ``_lock`` (a plain lock would deadlock)."""
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
                links = self._links.copy().items()  # one C call: a finalizer's discard cannot change it midway
            pids = {pid for _, peers in links for pid in peers if pid}
            states = {pid: stopped(pid) for pid in pids}  # each peer read once a poll, however many sets it shares
            now = time.monotonic()  # after the reads: a stop is counted from no earlier than it was seen
            clock.poll(now)
            clock.keep(pids)
            stopped_for = {pid: clock.seen(pid, state, now) for pid, state in states.items()}
            for link, peers in links:
                self._check(link, peers, stopped_for)

    def _check(self, link, peers: list[int], stopped_for: dict[int, float]) -> None:
        page = link.page
        if page is None or page.aborted() is not None:
            return
        for rank, pid in enumerate(peers):
            if pid and stopped_for[pid] >= self.grace:
                if link.page is not page or page.generation != link.set_id:  # closed since it was read: its
                    return  # slot may be a newer set's now, whose ranks this stop says nothing of
                reason = (f"rank {rank} (pid {pid}), a peer of {link.label}, has been stopped (SIGSTOP, or a "
                          f"debugger) for {self.grace:g}s while its peers waited (PEERD_STOPPED_ABORT_S)")
                log.warning("%s: aborting the group", reason)
                page.abort(AbortCode.MEMBER_STOPPED, reason)
                self.discard(link)
                return


stopped_peers = StoppedPeers()
os.register_at_fork(after_in_child=stopped_peers.forget)
