"""The daemon's control pages: one per buffer set whose handles went out, in areas.

The page itself (layout, votes, abort word) is peerd.controlpage; this module
is the daemon's bookkeeping around it, kept apart from the rules of a set's
life, which call it through these hooks:

* ``place(bset)``: the set's handles go out (Rendezvous._open). Its page
  takes a free slot of its owner uid's area for that page size (a new area
  where none has room: AREA_PAGES slots each), zeroed and formatted then, so a
  rank that replaces a dead one starts on a fresh page with fresh rounds.
  The answer, ``[area id, offset, generation]``, goes out in the join reply;
  None (pages off, or no memfd) keeps the group on the message path.
* ``handout(bset)``: the fd channel's answer to a member asking for its
  set's page (``{group, name, rank, page: true}``; the daemon answers only a
  pid holding that rank of an OPENING or LIVE set, as for buffer fds): the
  fd of the set's area, so the process maps every later page of that area
  without asking again. With it goes the read end of the daemon's alive
  pipe: the daemon alone holds the write end, so a member sees EOF there the
  moment this daemon run ends, however it ends, and aborts its pages itself
  (peerd_client.pagelink): a killed daemon cannot.
* ``hold_dropped(bset, slot, why)``: a member died or released its hold; its
  peers' rounds and kernels end (MEMBER_DIED at once; MEMBER_LEFT after
  LEAVE_GRACE_S, see Note [A leaving rank aborts late]).
* ``set_failed(bset)`` and ``evicted(bset)``: every page of the group is
  aborted (SET_FAILED, EVICTED), the eviction before any memory is freed.
* ``set_freed(bset)``: the page is aborted (if nothing did before) and its
  slot is free again; an evicted set's slot only later, see Note [A slot
  outlives its evicted set].
* ``process_gone(pid)``: a process exited; the slots and areas it kept
  from reuse or from closing may go.

Areas are per (owner uid, page size), as arena chunks are per uid
(peerd.arena): a process maps its uid's area once, and every later set of
that uid, of any group, has its page there, so a new group's set needs no
fd fetch, mapping or GPU registration. A process is handed only its own
uid's areas: it can touch the pages of its own user's other groups, whose
buffers it could reach anyway, and no other user's (Note [Control page
layout], Trust). An area whose slots are all free is closed once its
processes all exited; while one lives, the area is kept as a spare for the
uid's next set, but only SPARE_AREAS_PER_UID of them per uid (the oldest
spare closes first), so a uid that once held many sets at once does not
leave the daemon an fd and a mapping for each area they filled. A member's
mapping keeps an area's memory alive anyway, so nothing is freed under anyone.

``shutdown()`` aborts every page (SHUTDOWN) and closes the areas. The first
abort of a page wins: its reason is the cause, not the aftermath.
"""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from .buffersets import BufferSet, Slot
from .controlpage import (
    COMMIT_ROUND,
    PAGE_HANDLES,
    AbortCode,
    ControlPage,
    PageError,
    new_instance_id,
    page_bytes,
)
from .fdroom import FdRoom
from .index import Index
from .pagearea import AREA_PAGES, Area
from .protocol import ErrorCode, ProtocolError

log = logging.getLogger("peerd.pages")

#: the share of the daemon's fd room (peerd.fdroom) areas may fill: a group without an area agrees through
#: messages, but a process the daemon cannot watch cannot join, so the rest is left to the pidfds
AREAS_FD_SHARE = 0.5

#: areas with every slot free kept open per uid while a process they were handed lives (see above)
SPARE_AREAS_PER_UID = 16

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

# Note [A slot outlives its evicted set]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A set freed the normal way (every rank released or died) leaves nobody on its page: a member
# closes its link, and its kernels are done (it synchronizes), before it releases. So the slot
# is free at once, and zeroed when the next set takes it. An evicted set is freed whoever holds
# it: a holder may still poll the page, vote into it, or run a kernel reading its abort word.
# Were the slot handed to another set of the uid, that holder could corrupt the newcomer's
# rounds, and it would read the newcomer's zeroed abort word as "go on". So the slot keeps the
# EVICTED abort and stays retired until every process it was handed to has exited
# (``process_gone``), as a shared arena chunk waits for its mappers (peerd.arena: Note [No free
# under a mapping]).


@dataclass
class _Area:
    id: int
    owner: int | None  # the one uid whose sets it holds
    page_size: int
    area: Area
    free: list[int]  # offsets of free slots, the lowest last (taken first)
    retired: dict[int, set[int]] = field(default_factory=dict)  # offset -> live pids: Note [A slot outlives ...]
    mappers: set[int] = field(default_factory=set)  # live pids a page of it was placed for
    closed: bool = False

    @property
    def unused(self) -> bool:
        """Every slot free: no set's page in it, none retired."""
        return len(self.free) == AREA_PAGES


@dataclass
class _Entry:
    set_id: int
    group: str
    area: _Area
    offset: int
    page: ControlPage
    aborted: bool = False
    evicted_from: set[int] = field(default_factory=set)  # live pids still handed it when it was evicted


class Pages:
    """Every control page this daemon run placed, by buffer set id, and the areas holding them."""

    def __init__(self, enabled: bool = True, room: FdRoom | None = None) -> None:
        self.instance = new_instance_id()  # announced in hello; written into every page
        self.enabled = enabled
        self._fd_room = room or FdRoom()  # an area's memfd takes a place: peerd.fdroom
        self._pages: dict[int, _Entry] = {}
        self._of_group: Index[tuple[int | None, str], int, _Entry] = Index()  # (owner uid, group) -> its pages: a
        # failing set looks at its own group's alone
        self._areas: dict[tuple[int | None, int], list[_Area]] = {}  # (owner uid, page size) -> open areas
        self._area_ids = itertools.count(1)
        self._spares: Index[int | None, int, _Area] = Index()  # uid -> its unused areas still mapped, oldest first
        self._of_pid: Index[int, int, _Area] = Index()  # pid -> the open areas it is a mapper of: a death
        # looks at those alone
        self._alive_r, self._alive_w = os.pipe()  # non-inheritable: no child of the daemon holds the write end

    # ------------------------------------------------------------ placing, and the fd channel

    def place(self, bset: BufferSet) -> list[int] | None:
        """A zeroed page for ``bset``, whose handles go out now: ``[area id, offset, generation]``
        for the join reply, or None (its ranks agree through messages)."""
        if not self.enabled:
            return None
        size = page_bytes(bset.npes)
        try:
            area = self._room(bset.owner_uid, size)
        except (PageError, OSError) as err:
            log.warning("%s gets no control page (%s): its ranks agree through messages", bset.label, err)
            return None
        self._spares.discard(bset.owner_uid, area.id)
        offset = area.free.pop()
        page = area.area.page_at(offset, size)
        page.format(bset.npes, self.instance, bset.id)
        for pid in {s.pid for s in bset.slots.values()}:
            area.mappers.add(pid)
            self._of_pid.add(pid, area.id, area)
        entry = self._pages[bset.id] = _Entry(bset.id, bset.group, area, offset, page)
        self._of_group.add((bset.owner_uid, bset.group), bset.id, entry)
        return [area.id, offset, bset.id]

    def _room(self, owner: int | None, size: int) -> _Area:
        """An area of the pages of uid ``owner`` of ``size`` bytes with a free slot, made where none has one."""
        for area in self._areas.get((owner, size), []):
            if area.free:
                return area
        if not self._fd_room.take(within=AREAS_FD_SHARE):
            raise PageError(self._fd_room.describe())
        try:
            made = Area.create(size)
        except BaseException:
            self._fd_room.give()
            raise
        area = _Area(next(self._area_ids), owner, size, made, free=list(range(size * (AREA_PAGES - 1), -1, -size)))
        self._areas.setdefault((owner, size), []).append(area)
        log.info("control page area %d made for uid %s: %d pages of %d bytes", area.id, owner, AREA_PAGES, size)
        return area

    @staticmethod
    def split_request(request: Any) -> tuple[bool, Any]:
        """(whether the fd request asks for the control page, the request naming the slot)."""
        if isinstance(request, dict) and "page" in request:
            rest = {k: v for k, v in request.items() if k != "page"}
            return request["page"] is True, rest
        return False, request

    def handout(self, bset: BufferSet) -> tuple[list[bytes], list[int]]:
        """The fd channel's answer for the page of ``bset``, a set whose handles went out: its area."""
        if not self.enabled:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "this daemon runs with --control-pages false: "
                                "groups agree through its messages")
        entry = self._pages.get(bset.id)
        if entry is None:
            raise ProtocolError(ErrorCode.ALLOCATION_FAILED, f"{bset.label} has no control page (the daemon could "
                                "not make one: its log says why): its ranks agree through messages")
        return list(PAGE_HANDLES), [entry.area.area.fd, self._alive_r]

    # ------------------------------------------------------------ hooks of the set's life

    def holds(self, bset: BufferSet) -> bool:
        """Whether ``bset`` has a page (its ranks may commit on it)."""
        return bset.id in self._pages

    def committed(self, bset: BufferSet, rank: int) -> None:
        """``rank`` committed ok through a message, having no mapping of the page: its vote in the
        commit round (the page's round 1) goes on the page, where its peers wait for it."""
        entry = self._pages.get(bset.id)
        if entry is not None and not entry.aborted:
            entry.page.vote_for(rank, COMMIT_ROUND, True)

    def commit_agreed(self, bset: BufferSet) -> bool:
        """Before the daemon fails an opening set: whether its commit round on the page agreed already
        (every rank voted yes there, and may have gone on past it); where it did not, it never can now."""
        entry = self._pages.get(bset.id)
        return entry is not None and (entry.page.close_round(COMMIT_ROUND) or entry.page.every_rank_past(COMMIT_ROUND))

    def commit_seen_agreed(self, bset: BufferSet) -> bool:
        """Whether the set's commit round on the page has agreed (or every rank went past it), deciding
        nothing: the daemon's looks, and a yes by message or post, settle the set live only then."""
        entry = self._pages.get(bset.id)
        return entry is not None and (entry.page.round_agreed(COMMIT_ROUND) or entry.page.every_rank_past(COMMIT_ROUND))

    def hold_dropped(self, bset: BufferSet, slot: Slot, why: str) -> None:
        """A member died or released: its peers must not wait on it any more."""
        code = AbortCode.MEMBER_DIED if slot.dead else AbortCode.MEMBER_LEFT
        self._abort(bset.id, code, f"rank {slot.rank} (pid {slot.pid}) of {bset.label} {why}")

    def set_failed(self, bset: BufferSet) -> None:
        """A set of the group failed: every page of the group aborts with its verdict."""
        reason = bset.failure.message if bset.failure else f"{bset.label} failed"
        for set_id in list(self._of_group.get((bset.owner_uid, bset.group), ())):
            self._abort(set_id, AbortCode.SET_FAILED, reason)

    def evicted(self, bset: BufferSet) -> None:
        """Called before an evicted set's memory is freed: no kernel may touch it after, and its
        slot waits for its processes. See Note [A slot outlives its evicted set]."""
        entry = self._pages.get(bset.id)
        if entry is not None:
            entry.page.close_round(COMMIT_ROUND)  # an opening set's commit ends False on the page, as by message
            self._abort_entry(entry, AbortCode.EVICTED, f"{bset.label} was evicted by an administrator")
            entry.evicted_from = {s.pid for s in bset.slots.values()} & entry.area.mappers

    def set_freed(self, bset: BufferSet) -> None:
        entry = self._pages.pop(bset.id, None)
        if entry is None:
            return
        self._of_group.discard((entry.area.owner, entry.group), bset.id)
        self._abort_entry(entry, AbortCode.SET_FAILED, f"{bset.label} was freed")
        area = entry.area
        if entry.evicted_from:
            area.retired[entry.offset] = entry.evicted_from
            log.info("the control page of set %d stays retired until pids %s exit", entry.set_id,
                     sorted(entry.evicted_from))
        else:
            area.free.append(entry.offset)
        self._settle(area)

    def process_gone(self, pid: int) -> None:
        """A process exited, and its mappings with it: the slots and areas it kept may go."""
        for area in self._of_pid.pop(pid, {}).values():
            area.mappers.discard(pid)
            for offset, pids in list(area.retired.items()):
                pids.discard(pid)
                if not pids:
                    del area.retired[offset]
                    area.free.append(offset)
                    log.info("control page at offset %d of area %d is free again: every process its evicted set "
                             "was handed to exited", offset, area.id)
            self._settle(area)

    def _settle(self, area: _Area) -> None:
        """An unused area closes once no process it was handed lives, else it waits as one of its uid's
        spares; past SPARE_AREAS_PER_UID of them the oldest closes, its members' mappings living on."""
        if area.closed or not area.unused:
            return
        if not area.mappers:
            self._close(area, "every page free, every process gone")
            return
        spares = self._spares.setdefault(area.owner, {})
        spares.setdefault(area.id, area)
        while len(spares) > SPARE_AREAS_PER_UID:
            self._close(next(iter(spares.values())), f"the oldest of more than {SPARE_AREAS_PER_UID} unused areas "
                        "of its uid (its members' mappings keep their memory)")

    def _close(self, area: _Area, why: str) -> None:
        areas = self._areas[(area.owner, area.page_size)]
        areas.remove(area)
        if not areas:
            del self._areas[(area.owner, area.page_size)]
        self._spares.discard(area.owner, area.id)
        for pid in area.mappers:
            self._of_pid.discard(pid, area.id)
        area.area.give_back()  # a member that kept the area mapped (or its fd) would keep the daemon's memory
        area.area.close()
        self._fd_room.give()
        area.closed = True
        log.info("control page area %d of uid %s closed: %s", area.id, area.owner, why)

    def draining(self, reason: str) -> None:
        """The daemon takes no more joins: every group is aborted now, while its memory stays for the grace,
        so engines stop their kernels and release before it is freed (a group has no future set here)."""
        self._abort_all(reason)

    def shutdown(self) -> None:
        """Abort every page and close every area; members see the alive pipe close too."""
        self._abort_all("the peerd daemon is shutting down")
        for areas in self._areas.values():
            for area in areas:
                area.area.close()
                self._fd_room.give()
        self._pages.clear()
        self._areas.clear()
        self._spares.clear()
        self._of_pid.clear()
        self._of_group.clear()
        for fd in (self._alive_r, self._alive_w):
            if fd >= 0:
                os.close(fd)
        self._alive_r = self._alive_w = -1

    def __len__(self) -> int:
        """Sets holding a page."""
        return len(self._pages)

    @property
    def areas(self) -> int:
        """Areas open now."""
        return sum(map(len, self._areas.values()))

    def _abort_all(self, reason: str) -> None:
        for entry in self._pages.values():
            entry.page.close_round(COMMIT_ROUND)  # as for an eviction
            self._abort_entry(entry, AbortCode.SHUTDOWN, reason)

    def _abort(self, set_id: int, code: AbortCode, reason: str) -> None:
        entry = self._pages.get(set_id)
        if entry is not None:
            self._abort_entry(entry, code, reason)

    @staticmethod
    def _abort_entry(entry: _Entry, code: AbortCode, reason: str) -> None:
        if not entry.aborted:
            entry.aborted = True
            # a member that aborted it first (a peer it saw stopped) gave the cause; one forging an abort gains
            # nothing it could not do with its own group's page anyway
            if entry.page.abort(code, reason):
                log.info("control page of set %d aborted: %s", entry.set_id, reason)  # read nothing else off it


class NoPages:
    """The hooks where a registry runs without pages (the unit tests of the rules)."""

    def place(self, bset: BufferSet) -> None:
        return None

    def holds(self, bset: BufferSet) -> bool:
        return False

    def committed(self, bset: BufferSet, rank: int) -> None:
        pass

    def commit_agreed(self, bset: BufferSet) -> bool:
        return False

    def commit_seen_agreed(self, bset: BufferSet) -> bool:
        return False

    def process_gone(self, pid: int) -> None:
        pass

    def hold_dropped(self, bset: BufferSet, slot: Slot, why: str) -> None:
        pass

    def set_failed(self, bset: BufferSet) -> None:
        pass

    def evicted(self, bset: BufferSet) -> None:
        pass

    def set_freed(self, bset: BufferSet) -> None:
        pass
