"""The daemon's control pages: one per buffer set whose handles went out.

The page itself (layout, votes, abort word) is peerd.controlpage; this module
is the daemon's bookkeeping around it, kept apart from the rules of a set's
life, which call it through four hooks:

* ``handout(bset)``: the fd channel's answer to a member asking for its
  set's page (``{group, name, rank, page: true}``; the daemon answers only a
  pid holding that rank of an OPENING or LIVE set, as for buffer fds). The
  page is made on the first such request, so one page per set generation,
  made after its handles went out, for every backend (cuda and hip pass no
  buffer fds, but the page goes out all the same). With it goes the read end
  of the daemon's alive pipe: the daemon alone holds the write end, so a
  member sees EOF there the moment this daemon run ends, however it ends, and
  aborts the page itself (peerd_client.pagelink): a killed daemon cannot.
* ``hold_dropped(bset, slot, why)``: a member died or released its hold; its
  peers' rounds and kernels end (MEMBER_DIED at once; MEMBER_LEFT after
  LEAVE_GRACE_S, see Note [A leaving rank aborts late]).
* ``set_failed(bset)`` and ``evicted(bset)``: every page of the group is
  aborted (SET_FAILED, EVICTED), the eviction before any memory is freed.
* ``set_freed(bset)``: the daemon closes its fd and mapping; members keep
  theirs until they close.

``shutdown()`` aborts every page (SHUTDOWN) and closes them. The first abort
of a page wins: its reason is the cause, not the aftermath.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from .buffersets import BufferSet, Slot
from .controlpage import PAGE_HANDLES, AbortCode, ControlPage, PageError, new_instance_id
from .protocol import ErrorCode, ProtocolError

log = logging.getLogger("peerd.pages")

#: seconds a released rank's peers may still hold its set before their page is aborted; see Note [A
#: leaving rank aborts late]
LEAVE_GRACE_S = 1.0

# Note [A leaving rank aborts late]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A rank that releases a live set has finished with it, but its peers may not have: one whose
# all-reduce kernel was launched before the release, and runs after it, would see the abort
# word, stop, and (an eager call that does not synchronize) leave its output unwritten. Every
# rank's data is already in place when one rank's call returns, so such a peer finishes in
# microseconds if nothing stops it. So a release aborts the page only if some peer still holds
# the set LEAVE_GRACE_S later (then it would otherwise wait forever on the departed rank); a job
# whose ranks all close within that time never aborts anything. A death aborts at once: a dead
# rank's last call may be unfinished.

@dataclass
class _Entry:
    set_id: int
    group: tuple[int | None, str]  # (owner uid, group)
    page: ControlPage
    aborted: bool = False


class Pages:
    """Every control page this daemon run made, by buffer set id."""

    def __init__(self, enabled: bool = True) -> None:
        self.instance = new_instance_id()  # announced in hello; written into every page
        self.enabled = enabled
        self._pages: dict[int, _Entry] = {}
        self._refused: dict[int, str] = {}  # set id -> why its page could not be made: warned once
        self._alive_r, self._alive_w = os.pipe()  # non-inheritable: no child of the daemon holds the write end

    # ------------------------------------------------------------ the fd channel

    @staticmethod
    def split_request(request: Any) -> tuple[bool, Any]:
        """(whether the fd request asks for the control page, the request naming the slot)."""
        if isinstance(request, dict) and "page" in request:
            rest = {k: v for k, v in request.items() if k != "page"}
            return request["page"] is True, rest
        return False, request

    def handout(self, bset: BufferSet) -> tuple[list[bytes], list[int]]:
        """The fd channel's answer for the page of ``bset``, a set whose handles went out."""
        if not self.enabled:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "this daemon runs with --control-pages false: "
                                "groups agree through its messages")
        entry = self._pages.get(bset.id)
        if entry is None and bset.id not in self._refused:
            try:
                page = ControlPage.create(bset.npes, self.instance, bset.id)
                entry = self._pages[bset.id] = _Entry(bset.id, (bset.owner_uid, bset.group), page)
            except (PageError, OSError) as err:
                self._refused[bset.id] = str(err)
                log.warning("%s gets no control page (%s): its ranks agree through messages", bset.label, err)
        if entry is None:
            why = self._refused[bset.id]
            raise ProtocolError(ErrorCode.ALLOCATION_FAILED, f"no control page for {bset.label}: {why}")
        return list(PAGE_HANDLES), [entry.page.fd, self._alive_r]

    # ------------------------------------------------------------ hooks of the set's life

    def hold_dropped(self, bset: BufferSet, slot: Slot, why: str) -> None:
        """A member died or released: its peers must not wait on it any more."""
        code = AbortCode.MEMBER_DIED if slot.dead else AbortCode.MEMBER_LEFT
        self._abort(bset.id, code, f"rank {slot.rank} (pid {slot.pid}) of {bset.label} {why}")

    def set_failed(self, bset: BufferSet) -> None:
        """A set of the group failed: every page of the group aborts with its verdict."""
        reason = bset.failure.message if bset.failure else f"{bset.label} failed"
        for set_id, entry in list(self._pages.items()):
            if entry.group == (bset.owner_uid, bset.group):
                self._abort(set_id, AbortCode.SET_FAILED, reason)

    def evicted(self, bset: BufferSet) -> None:
        """Called before an evicted set's memory is freed: no kernel may touch it after."""
        self._abort(bset.id, AbortCode.EVICTED, f"{bset.label} was evicted by an administrator")

    def set_freed(self, bset: BufferSet) -> None:
        self._refused.pop(bset.id, None)
        entry = self._pages.pop(bset.id, None)
        if entry is not None:
            self._abort_entry(entry, AbortCode.SET_FAILED, f"{bset.label} was freed")
            entry.page.close()

    def shutdown(self) -> None:
        """Abort and close every page; members see the alive pipe close too."""
        for entry in self._pages.values():
            self._abort_entry(entry, AbortCode.SHUTDOWN, "the peerd daemon is shutting down")
            entry.page.close()
        self._pages.clear()
        self._refused.clear()
        for fd in (self._alive_r, self._alive_w):
            if fd >= 0:
                os.close(fd)
        self._alive_r = self._alive_w = -1

    def __len__(self) -> int:
        return len(self._pages)

    def _abort(self, set_id: int, code: AbortCode, reason: str) -> None:
        entry = self._pages.get(set_id)
        if entry is not None:
            self._abort_entry(entry, code, reason)

    @staticmethod
    def _abort_entry(entry: _Entry, code: AbortCode, reason: str) -> None:
        if not entry.aborted:
            entry.aborted = True
            entry.page.abort(code, reason)
            log.info("control page of set %d aborted: %s", entry.set_id, reason)  # read nothing off the page


class NoPages:
    """The hooks where a registry runs without pages (the unit tests of the rules)."""

    def hold_dropped(self, bset: BufferSet, slot: Slot, why: str) -> None:
        pass

    def set_failed(self, bset: BufferSet) -> None:
        pass

    def evicted(self, bset: BufferSet) -> None:
        pass

    def set_freed(self, bset: BufferSet) -> None:
        pass
