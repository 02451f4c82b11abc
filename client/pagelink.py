"""A member's link to its set's control page, and tp_agree on it.

The join reply says where the set's page is (``page: [area id, offset,
generation]``, peerd.pages). A process keeps every control page area it
was given mapped for its whole life, keyed by (daemon instance, area id),
and registered once with the GPU where a buffer lives on one
(peerd_client.hostmap): only the first PeerBuffer per area asks the
daemon's fd channel for it, sending the request before it opens the set's
chunks and reading the answer after; every later one builds a view at area
base + offset, checks its header, marks it mapped and goes on, with no
message, mmap or driver call. One watch per daemon run per process reads the
daemon's alive pipe and, when that run ends, aborts the page of every open
link of it. Anything that fails on the way (an old daemon that announces no
instance, a set without a page, a page from another daemon run, no memfd)
costs one WARNING and leaves the rank on the daemon's message path, never a
crash. On CUDA the area is registered with the GPU at the first
``abort_address`` (peerd_client.hostmap); a registration that fails then
leaves the votes on the page and the rank's kernels polling no abort word,
as on the message path, with a WARNING. Whether the group as a whole takes
the page is read after the commit verdict (Note [Control page layout],
"The choice"), so every rank takes the same path.

A GroupLink is kept per group key while its PeerBuffer is open; tp_agree
asks ``link_for(key)``: with a page it votes there, without one it still
learns from the link which daemon run the group's set came from, so a vote
after a restart is False, never True.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from dataclasses import dataclass
from typing import Any

from peerd.controlpage import COMMIT_ROUND, PAGE_HANDLES, AbortCode, ControlPage
from peerd.pagearea import Area
from peerd.fdchannel import FdRequest
from peerd.pageagree import PageVoter, native_voter
from peerd.paths import fd_socket_path

from .connection import REQUEST_TIMEOUT_S
from .errors import MonoUnsupported
from .stoppedpeers import stopped_peers

log = logging.getLogger("peerd_client")


class _DaemonWatch:
    """Aborts the pages of its daemon run's open links once that run is gone: EOF on its alive pipe."""

    def __init__(self, alive_fd: int, instance: int):
        self._alive, self._instance = alive_fd, instance
        self._lock = threading.RLock()  # a collection pass under it may close a collected buffer's link
        self._links: set[GroupLink] = set()
        self.gone = False  # the daemon run is over: tp_agree says DaemonUnavailable, as on the message path
        threading.Thread(target=self._watch, name="peerd-daemon-watch", daemon=True).start()

    def _watch(self) -> None:
        poller = select.poll()
        poller.register(self._alive, select.POLLIN | select.POLLHUP)
        poller.poll()
        os.close(self._alive)
        with self._lock:
            self.gone = True
            links = list(self._links)
        for link in links:  # no reuse can race this: the daemon that reuses slots is gone
            page = link.page
            if page is not None:
                self._abort(page)

    def _abort(self, page: ControlPage) -> None:
        if page.aborted() is None:
            page.abort(AbortCode.SHUTDOWN, f"the peerd daemon (instance {self._instance:#x}) is gone: it "
                                           "died or stopped; build the PeerBuffer again once it runs")

    def add(self, link: "GroupLink") -> None:
        with self._lock:
            self._links.add(link)
            gone = self.gone
        if gone:
            self._abort(link.page)

    def discard(self, link: "GroupLink") -> None:
        with self._lock:
            self._links.discard(link)


@dataclass
class _HeldArea:
    area: Area
    watch: _DaemonWatch
    gpu: Any = None  # hostmap.MappedArea, once a buffer of this process lives on a GPU


_areas: dict[tuple[int, int], _HeldArea] = {}  # (daemon instance, area id) -> mapped for this process's life
_watches: dict[int, _DaemonWatch] = {}  # daemon instance -> its watch
_areas_lock = threading.Lock()


def ask_area(conn, slot: dict, instance: int, area_id: int) -> FdRequest | None:
    """Area ``area_id``'s request, sent now unless this process holds the area already: the daemon
    answers while the caller opens its chunks, and ``_held_area`` reads the answer."""
    if (instance, area_id) in _areas:
        return None
    return FdRequest(fd_socket_path(conn.path), {**slot, "page": True}, REQUEST_TIMEOUT_S, daemon_pid=conn.hello["pid"],
                     daemon_uid=conn.daemon_uid)


def _held_area(conn, slot: dict, instance: int, area_id: int, asked: FdRequest | None) -> _HeldArea:
    """Area ``area_id`` of daemon run ``instance``, mapped here; fetched over the fd channel the first
    time, from the answer to ``asked`` where the request went out already."""
    with _areas_lock:
        held = _areas.get((instance, area_id))
        if held is not None:  # another thread of this process mapped it meanwhile
            if asked is not None:
                asked.close()
            return held
        if asked is None:
            asked = ask_area(conn, slot, instance, area_id)
        handles, fds = asked.reply()
        if handles != PAGE_HANDLES or len(fds) != 2:
            for fd in fds:
                os.close(fd)
            raise MonoUnsupported(f"the daemon's fd channel sent {handles!r}, not a control page area")
        area_fd, alive_fd = fds
        try:
            area = Area.attach(area_fd)  # closes area_fd: the mapping keeps the memory
            watch = _watches.get(instance)
            if watch is None:
                watch = _watches[instance] = _DaemonWatch(alive_fd, instance)
                alive_fd = -1
        finally:
            if alive_fd >= 0:
                os.close(alive_fd)
        held = _areas[(instance, area_id)] = _HeldArea(area, watch)
        return held


#: the aborts members write themselves, which the daemon learns only from a member's commit no
MEMBERS_ABORTS = (AbortCode.MEMBER_STOPPED, AbortCode.MEMBER_ABORTED)


class GroupLink:
    """What a member's tp_agree needs of its group's live set: the daemon run it came
    from and, where the whole group chose it, the control page."""

    def __init__(self, instance: int | None, rank: int, npes: int, label: str, agreement_timeout: float,
                 set_id: int):
        self.instance, self.rank, self.npes, self.label = instance, rank, npes, label
        self.set_id = set_id  # the join reply's: a newer set of the group may supersede it
        self.superseded = False  # a newer link of the group serves its votes (open_link)
        self.agreement_timeout = agreement_timeout  # the daemon's default: tp_agree's when it names none
        self.page: ControlPage | None = None
        self.mapped = None  # hostmap.MappedPage where the buffer is on a GPU
        self.voter: PageVoter | None = None
        self.on_gpu = False  # kernels poll ``mapped``, never the host page
        self._watch: _DaemonWatch | None = None
        self._asked: FdRequest | Exception | None = None  # the page area's request, sent by ask()

    @property
    def daemon_gone(self) -> bool:
        """The daemon run that made the page ended (its alive pipe closed)."""
        return self._watch is not None and self._watch.gone

    @property
    def abort_source(self):
        """What all_reduce polls: on a GPU the page mapped there (None if its area's registration
        failed), else the page itself; None without a page."""
        if self.mapped is not None and not self.mapped.usable(self.label):
            self.mapped = None
        return self.mapped if self.on_gpu else self.page

    def ask(self, conn, slot: dict, location: list[int] | None) -> None:
        """Send the request for the area of the page at ``location`` now, where this process lacks
        it, so the daemon answers while the set's chunks open; attach() reads the answer."""
        if self.instance is None or location is None:
            return
        try:
            self._asked = ask_area(conn, slot, self.instance, location[0])
        except Exception as err:  # raised by attach(), which stays on the message path
            self._asked = err

    def attach(self, conn, slot: dict, device, location: list[int] | None) -> None:
        """Find the page at ``location`` (the join reply's ``page``) in its area, mapped once per
        process, and mark it; on any failure stay on the message path (one WARNING)."""
        asked, self._asked = self._asked, None
        try:
            if self.instance is None:
                raise MonoUnsupported("the daemon announces no instance id: it predates control pages")
            if location is None:
                raise MonoUnsupported("the daemon placed no control page for this set: it runs with "
                                      "--control-pages false, or could not make one (its log says why)")
            if isinstance(asked, Exception):
                raise asked
            native_voter()  # before the mark: a rank that could not vote on the page must not choose it
            area_id, offset, generation = location
            held = _held_area(conn, slot, self.instance, area_id, asked)
            asked = None
            self.page = held.area.page(offset, self.npes, instance=self.instance, generation=generation)
            if device.type == "cuda":
                from .hostmap import MappedArea, MappedPage  # torch and the GPU runtime: only where a GPU is used

                if held.gpu is None:
                    held.gpu = MappedArea(held.area.address, held.area.size)
                self.mapped = MappedPage(self.page, held.gpu, device)
                if not held.gpu.registers_in_capture:  # registered now, never inside a graph capture
                    held.gpu.base(device)
                self.on_gpu = True
            self._watch = held.watch
            self._watch.add(self)
            self.page.mark_mapped(self.rank)
        except Exception as err:  # a rank must reach its commit vote whatever happened here
            log.warning("%s has no control page, so its group agrees through the daemon's messages: %s: %s",
                        self.label, type(err).__name__, err)
            self.close()
        finally:
            if isinstance(asked, FdRequest):
                asked.close()

    def commit(self, timeout: float) -> dict:
        """The set's commit vote, on the page (COMMIT_ROUND): ``{ok, reason}`` as the daemon answers
        it, and ``aborted``: whether the reason came from the daemon (else this rank's round failed, or
        a member aborted the page, which the daemon has not heard of)."""
        self.voter = PageVoter(self.page, self.rank, self.label, commit_rounds=COMMIT_ROUND)
        verdict = self.voter.agree(True, time.monotonic() + timeout)
        if verdict.ok:
            return {"ok": True, "reason": "", "aborted": False}
        aborted = self.page.aborted()
        if aborted is not None:  # a member's own abort (a peer it saw stopped) is news to the daemon: told
            return {"ok": False, "reason": aborted.reason, "aborted": aborted.code not in MEMBERS_ABORTS}
        # the round's own reason says whether it timed out or a rank voted no
        return {"ok": False, "reason": f"the commit vote on the control page failed (waited at most {timeout:g}s): "
                                       f"{verdict.reason}", "aborted": False}

    def choose(self) -> None:
        """After the commit verdict: keep the page only if every rank mapped it."""
        if self.page is None:
            return
        missing = self.page.unmapped()
        if missing:
            log.info("%s: rank(s) %s have no control page: the group agrees through the daemon's messages",
                     self.label, missing)
            self.close()

    def close(self) -> None:
        """Stop using the page: its area stays mapped (and registered) for the next set in it. No
        kernel of this rank may still poll the page once its set is released."""
        voter, self.voter = self.voter, None
        if voter is not None:  # a thread still waiting for its turn on it votes nothing
            voter.close()
        asked, self._asked = self._asked, None
        if isinstance(asked, FdRequest):  # a set that failed before its page was attached
            asked.close()
        if self._watch is not None:
            self._watch.discard(self)
            self._watch = None
        stopped_peers.discard(self)
        self.mapped = self.page = None


_links: dict[str, list[GroupLink]] = {}
_links_lock = threading.RLock()  # reentrant: a finalizer's close_link may run inside open_link on its thread


def open_link(key: str, link: GroupLink, supersedes: list[int]) -> None:
    """``link`` serves its group's tp_agree while no older link of the group is open that it does not
    supersede (the join reply's ``supersedes``: sets of the group some rank no longer holds)."""
    with _links_lock:
        for older in list(_links.get(key, ())):
            if older.instance == link.instance and older.set_id in supersedes:
                older.superseded = True
        _links.setdefault(key, []).append(link)  # looked up again: a finalizer may have emptied the list


def close_link(key: str, link: GroupLink) -> None:
    with _links_lock:
        links = _links.get(key, [])
        if link in links:
            links.remove(link)
        if not links:
            _links.pop(key, None)
    link.close()


def link_for(key: str) -> GroupLink | None:
    """The group's oldest open link of the newest daemon run among them that no newer link superseded:
    every rank opened its sets in the same order, and learned which sets a newer one supersedes in
    the same reply. A set kept open across a daemon restart, or one a peer left before the group
    built another set with this process, serves no vote once that other set is open: its votes would
    be False, or DaemonUnavailable, for good, while the peer votes on the newer set."""
    links = list(_links.get(key, ()))  # a copy, one step under the GIL: another thread (or a finalizer) may close
    # one meanwhile; no lock on tp_agree's path
    if not links:
        return None
    newest = [link for link in links if link.instance == links[-1].instance]
    return next((link for link in newest if not link.superseded), newest[0])  # the superseding one closed


def _forget_after_fork() -> None:
    global _areas_lock, _links_lock
    _links_lock = threading.RLock()
    _links.clear()  # a forked child holds none of its parent's ranks,
    _areas.clear()  # nor its registrations; the parent's watches run in no thread of the child
    _watches.clear()
    _areas_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)
