"""A member's link to its set's control page, and tp_agree on it.

After its join a PeerBuffer asks the daemon's fd channel for the set's
control page (peerd.pages): ``attach`` maps it, registers it with the GPU
where the buffer lives on one (peerd_client.hostmap), marks it mapped and
watches the daemon's alive pipe. Anything that fails on the way (an old
daemon that announces no instance, a page from another daemon run, no
memfd, cudaHostRegister refused) costs one WARNING and leaves the rank on
the daemon's message path, never a crash. Whether the group as a whole
takes the page is read after the commit verdict (Note [Control page
layout], "The choice"), so every rank takes the same path.

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

from peerd.controlpage import PAGE_HANDLES, AbortCode, ControlPage
from peerd.fdchannel import fetch_fds
from peerd.pageagree import PageVoter, native_voter
from peerd.paths import fd_socket_path

from .connection import REQUEST_TIMEOUT_S
from .errors import MonoUnsupported

log = logging.getLogger("peerd_client")


class _DaemonWatch:
    """Aborts the page once the daemon run that made it is gone: EOF on its alive pipe."""

    def __init__(self, alive_fd: int, page: ControlPage, instance: int):
        self._alive = alive_fd
        self._stop_r, self._stop_w = os.pipe()
        self._page, self._instance = page, instance
        self.gone = False  # the daemon run is over: tp_agree says DaemonUnavailable, as on the message path
        self._thread = threading.Thread(target=self._watch, name="peerd-daemon-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        poller = select.poll()
        poller.register(self._alive, select.POLLIN | select.POLLHUP)
        poller.register(self._stop_r, select.POLLIN)
        try:
            events = dict(poller.poll())
            self.gone = self._stop_r not in events
            if self.gone and self._page.aborted() is None:
                self._page.abort(AbortCode.SHUTDOWN, f"the peerd daemon (instance {self._instance:#x}) is gone: it "
                                                     "died or stopped; build the PeerBuffer again once it runs")
        finally:
            os.close(self._alive)

    def stop(self) -> None:
        os.write(self._stop_w, b"x")
        if threading.current_thread() is not self._thread:  # a collection pass may run in the watcher itself
            self._thread.join()
        os.close(self._stop_r)
        os.close(self._stop_w)


class GroupLink:
    """What a member's tp_agree needs of its group's live set: the daemon run it came
    from and, where the whole group chose it, the control page."""

    def __init__(self, instance: int | None, rank: int, npes: int, label: str, agreement_timeout: float):
        self.instance, self.rank, self.npes, self.label = instance, rank, npes, label
        self.agreement_timeout = agreement_timeout  # the daemon's default: tp_agree's when it names none
        self.page: ControlPage | None = None
        self.mapped = None  # hostmap.MappedPage where the buffer is on a GPU
        self.voter: PageVoter | None = None
        self._watch: _DaemonWatch | None = None

    @property
    def daemon_gone(self) -> bool:
        """The daemon run that made the page ended (its alive pipe closed)."""
        return self._watch is not None and self._watch.gone

    @property
    def abort_source(self):
        """What all_reduce polls: the GPU mapping, else the page itself, else None."""
        return self.mapped or self.page

    def attach(self, conn, slot: dict, device) -> None:
        """Fetch, map and mark the page; on any failure stay on the message path (one WARNING)."""
        fds: list[int] = []
        try:
            if self.instance is None:
                raise MonoUnsupported("the daemon announces no instance id: it predates control pages")
            native_voter()  # before the mark: a rank that could not vote on the page must not choose it
            handles, fds = fetch_fds(fd_socket_path(conn.path), {**slot, "page": True}, REQUEST_TIMEOUT_S,
                                     daemon_pid=conn.hello["pid"])
            if handles != PAGE_HANDLES:
                raise MonoUnsupported(f"the daemon's fd channel sent {handles!r}, not a control page")
            page_fd, alive_fd = fds
            fds = [alive_fd]  # the page owns page_fd from here on, refused or not
            self.page = ControlPage.attach(page_fd, npes=self.npes, instance=self.instance)
            if device.type == "cuda":
                from .hostmap import MappedPage  # torch and the GPU runtime: only where a GPU is used

                self.mapped = MappedPage(self.page, device)
            self._watch = _DaemonWatch(alive_fd, self.page, self.instance)
            fds = []
            self.page.mark_mapped(self.rank)
        except Exception as err:  # a rank must reach its commit vote whatever happened here
            log.warning("%s has no control page, so its group agrees through the daemon's messages: %s: %s",
                        self.label, type(err).__name__, err)
            for fd in fds:
                os.close(fd)
            self.close()

    def choose(self) -> None:
        """After the commit verdict: keep the page only if every rank mapped it."""
        if self.page is None:
            return
        missing = self.page.unmapped()
        if missing:
            log.info("%s: rank(s) %s have no control page: the group agrees through the daemon's messages",
                     self.label, missing)
            self.close()
            return
        self.voter = PageVoter(self.page, self.rank, self.label)

    def close(self) -> None:
        """Stop watching, unregister from the GPU, unmap; no kernel may still poll the page."""
        self.voter = None
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        if self.mapped is not None:
            self.mapped.close()
            self.mapped = None
        if self.page is not None:
            self.page.close()
            self.page = None


_links: dict[str, list[GroupLink]] = {}


def open_link(key: str, link: GroupLink) -> None:
    """``link`` serves its group's tp_agree while no older link of the group is open."""
    _links.setdefault(key, []).append(link)


def close_link(key: str, link: GroupLink) -> None:
    links = _links.get(key, [])
    if link in links:
        links.remove(link)
    if not links:
        _links.pop(key, None)
    link.close()


def link_for(key: str) -> GroupLink | None:
    """The group's oldest open link: every rank opened its sets in the same order."""
    links = _links.get(key)
    return links[0] if links else None


def _forget_after_fork() -> None:
    _links.clear()  # a forked child holds none of its parent's ranks


os.register_at_fork(after_in_child=_forget_after_fork)
