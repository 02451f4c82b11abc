"""The rules of a buffer set's life: rendezvous, commit vote, release, failure.

Who owns what (the memory note): the daemon allocates each rank's buffer when
that rank joins and is the only one that frees it. A rank *holds* the whole
buffer set from its join until its release or its death. Memory is freed
only when no rank holds the set any more, so a rank that exits can never pull
memory from under a peer's kernel. A set that fails before its handles went
out is freed at once: nobody can have mapped it.

Failure is reported to every waiting rank, never left to a hang: a mismatch,
an allocation failure, a timeout or a death fails the whole rendezvous, with
a message naming the ranks and pids involved.

Memory is reached only through the ``allocate`` and ``free`` callables given
at construction, so the unit tests drive every rule with fakes.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any, Callable, Sequence

from .backends.allocation import Allocation
from .buffersets import BufferSet, RankKey, SetIndex, Slot, State
from .index import Index
from .pages import LEAVE_GRACE_S, NoPages, Pages
from .credentials import Credentials
from .outbox import Caller, Outbox, Send, rank_out_of_range, refuse
from .protocol import ErrorCode, ProtocolError
from .quotas import Quotas
from .rounds import Round
from .sizes import human
from .timers import Timers, Waits

log = logging.getLogger("peerd.rendezvous")

Allocate = Callable[[int, str, int, "int | None"], Allocation]  # (nbytes, device, flags, owner uid)
Footprint = Callable[[int], int]  # nbytes -> the bytes its allocation takes
Free = Callable[[Allocation, Sequence[int]], None]  # (buffer, live pids an eviction took it from: they may map it)
Handed = Callable[[list[Allocation], list[int]], None]  # these pids were handed these buffers (they may map them)
Ready = Callable[[Allocation], bool]  # whether a buffer's memory may go out yet; ProtocolError where it never will
Left = Callable[["int | None", str, int, int, str], Outbox]  # (owner uid, group, rank, pid, reason): it left the group
Back = Callable[["int | None", str, int, int, bool], None]  # (owner uid, group, rank, pid, the set opened):
# it joined a set of the group

SetKey = tuple["int | None", str, str]  # (owner uid, group, name)


# Note [Failure verdicts are kept]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A failed set keeps its verdict for the ranks that have not heard it, so a
# rank that arrives late learns the failure instead of starting a new
# rendezvous that would wait for peers who already gave up. How long:
#
#   - a failed set some rank still holds keeps its verdict until its last
#     holder lets go (its memory goes then), unless a new rendezvous of its
#     key retires it first (see Note [Retired sets]);
#   - a failed set nobody holds is forgotten once every rank was told, or
#     else 2 x max(the daemon's rendezvous timeout, the longest timeout a rank
#     of the set asked for) after it failed (after it was created, where the
#     failure came with no time: a commit timeout, an eviction), so a rank
#     still coming within its own timeout hears it, and the key is free again
#     after that. Such a set does not count against --max-groups;
#   - a kept verdict whose every participant has exited (each process that
#     joined it, was refused by it, withdrew or heard it) is a job's
#     relaunch knocking, not a late rank of it: the verdict is forgotten and
#     the join starts a new rendezvous. Told the old launch's error (naming
#     its dead pids, a typo the relaunch fixed), one rank of a relaunch
#     failed at once while its peers waited out a rendezvous of their own.
#     A late rank of a job whose other processes all exited (a crash the
#     launcher did not end it with) waits out its rendezvous instead. Whether
#     a pid runs is asked with kill(pid, 0), which no /proc restriction
#     (the unit's ProtectProc=invisible) hides; a pid the kernel could not
#     name in the daemon's pid namespace (0) counts as running.


#: what a process refused a rank it still holds can do
CLOSE_FIRST = "; close that PeerBuffer first, or give each buffer set of one group its own name="

#: The daemon's looks at an opening set's commit round on its control page. Its ranks post only a no
#: (a round that failed there, with the reason), so a yes is read off the page: first this soon after
#: the handles went out (the ranks vote within about a millisecond of them), then at intervals doubling
#: up to the longest, until the set is live or failed. Nobody waits on the look: the ranks went on.
COMMIT_LOOK_FIRST_S = 0.002
COMMIT_LOOK_LONGEST_S = 1.0


def _still_held(caller: Caller, bset: BufferSet, held: Slot, advice: str, pid: int) -> Send:
    """RANK_TAKEN: the rank this caller (process ``pid``) asks for is held in ``bset``."""
    holder = f"this same process (pid {pid})" if held.pid == pid else f"pid {held.pid}"
    message = f"rank {held.rank} of {bset.label} is still held by {holder}{advice}"
    return refuse(caller, ErrorCode.RANK_TAKEN, message)


class Rendezvous:
    """Every buffer set's rules; the sets themselves live in ``index``."""

    def __init__(self, allocate: Allocate, free: Free, handed: Handed, timers: Timers, quotas: Quotas, waits: Waits,
                 pages: NoPages | Pages = NoPages(), ready: Ready = lambda allocation: True,
                 left: Left = lambda uid, group, rank, pid, reason: [],
                 back: Back = lambda uid, group, rank, pid, opened: None,
                 footprint: Footprint = lambda nbytes: nbytes, alive: Callable[[int], bool] = lambda pid: True):
        self.pages = pages  # the control pages: placed as a set opens, told as a member leaves, a set fails or is freed
        self._left, self._back = left, back  # the group's agreement, told as a member leaves it and comes back
        self._allocate = allocate
        self._footprint = footprint  # what the quotas check: the size the allocation will have, not the asked one
        self._ready = ready
        self._alive = alive  # whether a pid (as the kernel reported it; 0: not visible here) still runs
        self._unready: Index[bytes, int, BufferSet] = Index()  # chunk handle -> the sets every rank joined
        # that wait for memory there: a chunk's readiness asks those alone
        self._free = free
        self._handed = handed
        self._timers = timers
        self._quotas = quotas
        self._waits = waits
        self.index = SetIndex()
        self._verdicts: dict[int | None, dict[int, BufferSet]] = {}  # uid -> its kept verdicts, oldest first
        self.rank_deaths = 0  # processes that died holding a rank of a buffer set
        # set ids start at a random point, so a set id from an earlier daemon run names no set of this one
        self._ids = secrets.randbits(40) << 20

    # ------------------------------------------------------------ join and withdraw

    def join(self, caller: Caller, who: Credentials, req: dict[str, Any], now: float) -> Outbox:
        """A refused join fails the rendezvous its peers wait in (as a withdrawal does), so they hear why at
        once instead of waiting it out for a rank that never comes."""
        rank, npes, key = req["rank"], req["npes"], (who.uid, req["group"], req["name"])
        if invalid := rank_out_of_range(caller, req["group"], rank, npes):
            bset = self.index.current.get(key)
            if bset is None or bset.state is not State.JOINING:
                return [invalid]
            message = f"pid {who.pid} asked to join {bset.label} as rank {rank} of npes={npes}" + (
                f", but the set has npes={bset.npes}" if npes != bset.npes else ", past its last rank")
            return self._fail(bset, ErrorCode.GROUP_FAILED, message, now=now) + [invalid]
        refusal = self._quotas.shape_refusal(req)
        if refusal:
            failed, _ = self._cannot_take_part(caller, who, req, refusal, now)
            return failed + [refuse(caller, ErrorCode.LIMIT_EXCEEDED, refusal)]
        bset, out = self._set_to_join(caller, who, key, req, now)
        if bset is None:
            return out
        return self._take_slot(bset, caller, who, req, now)

    def _set_to_join(
        self, caller: Caller, who: Credentials, key: SetKey, req: dict[str, Any], now: float
    ) -> tuple[BufferSet | None, Outbox]:
        """The set ``rank`` joins, or the replies that end its join here."""
        rank = req["rank"]
        bset = self.index.current.get(key)
        refused = self._held_in_retired(key, rank, bset, caller, who.pid)
        if refused:
            return None, [refused]
        if bset is not None and bset.state is State.FAILED and not bset.holding_slots():
            if self._owed_verdict(bset):
                return None, [self._tell_failure(bset, rank, who.pid, caller)]
            log.info("%s: a join by pid %d after every process of the failed set exited: a relaunch, so the set's "
                     "verdict (%s) is forgotten and a new rendezvous starts", bset.label, who.pid, bset.failure.message)
            self._forget(bset)
            bset = None
        if bset is not None and bset.state is not State.JOINING:
            refused = self._supersede(bset, rank, caller, CLOSE_FIRST, who.pid)
            if refused:
                return None, [refused]
            bset = None
        if bset is None:
            refusal = self._room_refusal(key)
            if refusal:
                return None, [refuse(caller, ErrorCode.LIMIT_EXCEEDED, refusal)]
            return self._new_set(key, req["npes"], req["nbytes"], req["flags"], now), []
        taken = bset.slots.get(rank)
        if taken is not None:  # whatever it asks, a second claim on a rank cannot be this set's: only it is refused
            if who.pid != taken.pid:  # the usual sign of a rank mapping bug, for the timeout to name
                bset.claimed_again[rank] = who.pid
            message = f"rank {rank} of {bset.label} was already joined by pid {taken.pid}"
            return None, [refuse(caller, ErrorCode.RANK_TAKEN, message)]
        problem = bset.mismatch(req)
        if problem:
            bset.heard(rank, who.pid)
            return None, self._fail(bset, ErrorCode.MISMATCH, problem, [caller], now=now)
        return bset, []

    def _take_slot(self, bset: BufferSet, caller: Caller, who: Credentials, req: dict[str, Any], now: float) -> Outbox:
        """Allocate ``rank``'s buffer within its uid's and device's share; open the set once every rank is in."""
        rank, device, pid, uid = req["rank"], req["device"], who.pid, who.uid
        refusal = self._quotas.usage_refusal(self._footprint(bset.nbytes), uid, device)
        if refusal:
            bset.heard(rank, pid)
            message = f"rank {rank} (pid {pid}): {refusal}"
            return self._fail(bset, ErrorCode.LIMIT_EXCEEDED, message, [caller], now=now)
        try:
            allocation = self._allocate(bset.nbytes, device, bset.flags, bset.owner_uid)
        except ProtocolError as err:
            bset.heard(rank, pid)
            return self._fail(bset, err.code, f"rank {rank} (pid {pid}): {err.message}", [caller], now=now)
        self._quotas.charge(uid, allocation.device, allocation.size)
        slot = Slot(rank, pid, uid, device, allocation, now, waiter=caller, own_pid=req.get("own_pid"))
        self.index.take_slot(bset, slot)
        self._back(bset.owner_uid, bset.group, rank, pid, False)
        timeout = req["timeout"] or self._waits.rendezvous
        bset.patience = max(bset.patience, timeout)
        log.debug("%s rank=%d pid=%d joined (%d/%d) device=%s", bset.label, rank, pid, len(bset.slots), bset.npes,
                 device)
        out = self._open_when_ready(bset, now) if len(bset.slots) == bset.npes else []
        if bset.state is State.JOINING:  # its ranks, or (the last join's too) its memory, still to come
            bset.timers.append(self._timers.at(now + timeout, lambda t, b=bset: self._rendezvous_due(b, t)))
        return out

    def _open_when_ready(self, bset: BufferSet, now: float) -> Outbox:
        """Every rank joined: open the set once the memory of every rank is ready (a backend may still
        reserve it off the loop: ``memory_ready`` comes back here), or fail it where some never will be."""
        try:
            waiting = {s.allocation.handle for s in bset.slots.values() if not self._ready(s.allocation)}
        except ProtocolError as err:
            return self._fail(bset, err.code, f"{bset.label}: {err.message}", now=now)
        self._unwait(bset)
        for handle in waiting:
            self._unready.add(handle, bset.id, bset)
        return [] if waiting else self._open(bset, now)

    def _unwait(self, bset: BufferSet) -> None:
        for s in bset.slots.values():
            if s.allocation is not None:  # freed already: the set waits for nothing
                self._unready.discard(s.allocation.handle, bset.id)

    def memory_ready(self, now: float, handles: list[bytes]) -> Outbox:
        """The backend has memory ready that was not, in the chunks of ``handles``: open (or fail) the
        sets that waited for it there."""
        waiting = {bset.id: bset for handle in handles for bset in self._unready.get(handle, {}).values()}
        out: Outbox = []
        for bset in waiting.values():
            out += self._open_when_ready(bset, now)
        return out

    def withdraw(self, caller: Caller, who: Credentials, req: dict[str, Any], now: float) -> Outbox:
        """A rank that cannot take part: every rank waiting fails now, ranks still to come on arrival.

        The verdict is a failed set like any other (its rendezvous had no
        memory yet). See Note [Failure verdicts are kept].
        """
        if invalid := rank_out_of_range(caller, req["group"], req["rank"], req["npes"]):
            return [invalid]
        failed, refused = self._cannot_take_part(caller, who, req, req["reason"], now)
        return [refused] if refused else failed + [Send(caller, {})]

    def _cannot_take_part(self, caller: Caller, who: Credentials, req: dict[str, Any], reason: str,
                          now: float) -> tuple[Outbox, Send | None]:
        """Fail the rendezvous of the key ``req`` names for ``reason``: the ranks waiting hear it now, those
        still to come on arrival; or the refusal of a rank this process still holds in the key's live set."""
        key, pid, rank = (who.uid, req["group"], req["name"]), who.pid, req["rank"]
        bset = self.index.current.get(key)
        if bset is not None and bset.state is State.FAILED and not bset.holding_slots() and rank not in bset.told \
                and req["npes"] == bset.npes and self._owed_verdict(bset):
            # its peers failed already (refused alike, most often): this rank hears that verdict, so the key is
            # free for their next try once every rank did; a verdict of its own would wait for them all again.
            # A rank that heard it already comes from a relaunch: its own verdict replaces the old one, below
            self._hears(bset, rank, pid)
            return [], None
        if bset is not None and bset.state is not State.JOINING:
            refused = self._supersede(bset, rank, caller, "", pid)
            if refused:
                return [], refused
            bset = None
        if bset is None:
            if self._room_refusal(key):
                return [], None  # no room to keep the verdict: the others time out instead
            bset = self._new_set(key, req["npes"], 0, 0, now)
        bset.heard(rank, pid)
        message = f"rank {rank} (pid {pid}) of group={key[1]} name={key[2]} cannot take part: {reason}"
        return self._fail(bset, ErrorCode.GROUP_FAILED, message, now=now), None

    def _supersede(self, bset: BufferSet, rank: int, caller: Caller, advice: str, pid: int) -> Send | None:
        """A new rendezvous of a key whose set is past joining: refused while ``rank`` still holds the
        old set, else the old set retires. See Note [Retired sets]."""
        held = bset.slots.get(rank)
        if held is not None and held.held:
            return _still_held(caller, bset, held, advice, pid)
        if bset.holding_slots():
            self.index.retire(bset)
        else:  # a kept verdict: the new rendezvous replaces it
            self._forget(bset)
        return None

    def _held_in_retired(self, key: SetKey, rank: int, current: BufferSet | None, caller: Caller,
                         caller_pid: int) -> Send | None:
        """A process may not join a new rendezvous of a key as a rank it still holds in a retired set of
        the key: it would hold the rank twice over one key (another process may: the old one is on its
        way out). See Note [Retired sets]."""
        for bset in self.index.of_group(key[0], key[1]):
            held = bset.slots.get(rank) if bset.name == key[2] and bset is not current else None
            if held is not None and held.held and held.pid == caller_pid:
                return _still_held(caller, bset, held, CLOSE_FIRST, caller_pid)
        return None

    def _owed_verdict(self, bset: BufferSet) -> bool:
        """Whether failed set ``bset`` keeps its verdict for a joiner: a process of it still runs (a late rank
        of its job), else the join is a relaunch's. See Note [Failure verdicts are kept]."""
        return any(pid <= 0 or self._alive(pid) for pid in bset.participants())

    def _tell_failure(self, bset: BufferSet, rank: int, pid: int, caller: Caller) -> Send:
        """A late rank hears a kept verdict, as one: its own timeout= never ran. See Note [Failure verdicts
        are kept]."""
        self._hears(bset, rank, pid)
        failure = bset.failure
        advice = ("; a rank this late needs a longer timeout= on every rank (default: the daemon's "
                  "--rendezvous-timeout)" if failure.code is ErrorCode.TIMEOUT else "")
        message = f"{bset.label} had already failed when rank {rank} (pid {pid}) came: {failure.message}{advice}"
        return Send(caller, error=ProtocolError(failure.code, message))

    def _hears(self, bset: BufferSet, rank: int, pid: int) -> None:
        """``rank`` heard failed set ``bset``'s verdict: once every rank did, it is forgotten."""
        bset.heard(rank, pid)
        if len(bset.told) == bset.npes:
            self._forget(bset)

    def _room_refusal(self, key: SetKey) -> str | None:
        """Why the daemon may not keep one more set, of ``key``'s uid: its share, or the total."""
        return self._quotas.sets_refusal(self.sets_counted(), self.sets_of_uid_counted(key[0]), *key)

    def sets_counted(self) -> int:
        """Sets that count against --max-groups: every one but the kept verdicts, the failed sets nobody
        holds (a failed set nobody holds is always kept as one, or else forgotten)."""
        return self.index.size() - sum(map(len, self._verdicts.values()))

    def sets_of_uid_counted(self, uid: int | None) -> int:
        """``uid``'s sets that count against --max-groups-per-uid, as above."""
        return self.index.size_of(uid) - len(self._verdicts.get(uid, ()))

    def _new_set(self, key: SetKey, npes: int, nbytes: int, flags: int, now: float) -> BufferSet:
        """A rendezvous for ``key``, now the key's current set."""
        self._ids += 1
        bset = BufferSet(self._ids, key[1], key[2], npes, nbytes, flags, now, key[0])
        self.index.add(bset)
        return bset

    def _open(self, bset: BufferSet, now: float) -> Outbox:
        """Every rank joined: hand every rank every rank's handle in one reply."""
        bset.move(State.OPENING)
        self._timers.cancel(*bset.timers)
        bset.timers.clear()
        bset.commit = Round(bset.npes)
        slots = [bset.slots[r] for r in range(bset.npes)]
        body = {
            "backend": slots[0].allocation.backend,
            "handles": [s.allocation.handle for s in slots],
            "sizes": [s.allocation.size for s in slots],
            "offsets": [s.allocation.offset for s in slots],
            "chunk_sizes": [s.allocation.span for s in slots],
            "devices": [s.device for s in slots],
            # a member watches its peers (stopped?): by their pids as this daemon sees them, where it runs in
            # this daemon's pid namespace, else by their own claims, where they share its namespace
            "pids": [s.pid for s in slots],
            "own_pids": [s.own_pid for s in slots],
            "set": bset.id,
        }
        page = self.pages.place(bset)  # where its control page is; none: the group agrees through messages
        if page is not None:
            body["page"] = page
            self._look_at_commit_later(bset, now, COMMIT_LOOK_FIRST_S)
        superseded = self._superseded_by(bset)
        if superseded:
            body["supersedes"] = superseded
        self._handed([s.allocation for s in slots], [s.pid for s in slots])
        for s in slots:  # a process in a dead rank's place takes part from now on
            self._back(bset.owner_uid, bset.group, s.rank, s.pid, True)
        log.debug("%s ready: handles sent to %d ranks", bset.label, bset.npes)
        out = []
        for s in slots:
            out.append(Send(s.waiter, body))
            s.waiter = None
        return out

    def _superseded_by(self, bset: BufferSet) -> list[int]:
        """The group's other sets that some rank no longer holds (it released them, or died) while others
        still do: their holders vote on ``bset`` from now on (peerd_client.pagelink.link_for). Told to
        every rank in the same reply, so the ranks move together, whatever the old sets' pages show
        by then (a departure aborts a page only LEAVE_GRACE_S after the release)."""
        return sorted(other.id for other in self.index.of_group(bset.owner_uid, bset.group)
                      if other is not bset and other.holding_slots()
                      and any(not slot.held for slot in other.slots.values()))

    def _rendezvous_due(self, bset: BufferSet, now: float) -> Outbox:
        if bset.state is not State.JOINING:
            return []
        waited = now - min(s.joined_at for s in bset.slots.values())
        missing = bset.missing()
        why = (f"rank(s) {missing} of {bset.npes} never joined (joined: {bset.who()})" if missing else
               f"every rank joined, but the {human(bset.nbytes)} buffers of its ranks were still being reserved or "
               "zeroed")
        if missing and bset.claimed_again:
            twice = ", ".join(f"rank {r} by pid {pid}" for r, pid in sorted(bset.claimed_again.items()))
            why += f"; a rank was asked for again ({twice}): do two processes take one rank?"
        elsewhere = [f"rank {s.rank} (pid {s.pid}) waits in name={other.name}" for other in self.index.of_group(
            bset.owner_uid, bset.group) if other is not bset and other.state is State.JOINING
            for s in other.slots.values() if s.rank in missing and s.waiter is not None]
        if elsewhere:  # its join could not go out (peerd_client.connection.Connection.call)
            why += (f"; {', '.join(elsewhere)}, another set of the group: one process's calls take turns, so every "
                    "rank must build the sets of a group in the same order")
        message = f"rendezvous of {bset.label} timed out after {waited:.1f}s: {why}"
        return self._fail(bset, ErrorCode.TIMEOUT, message, now=now)

    def _fail(
        self, bset: BufferSet, code: ErrorCode, message: str, extra: list[Caller] = (), now: float | None = None,
        keep: bool = True,
    ) -> Outbox:
        """Fail a set for every rank waiting on it (and ``extra`` callers). See Note [Failure verdicts are kept]."""
        error = ProtocolError(code, message)
        log.warning("%s failed: %s", bset.label, message)
        self._unwait(bset)
        out = [Send(c, error=error) for c in extra]
        if bset.state is State.JOINING:
            # nobody has the handles yet, so nobody can have mapped the memory
            for s in bset.slots.values():
                if s.waiter is not None:
                    out.append(Send(s.waiter, error=error))
                    bset.told.add(s.rank)
                s.waiter = None
                self.index.let_go(bset, s)
            self._free_set(bset)
        elif bset.commit is not None and bset.commit.result is None:
            out += bset.commit.finish(False, message)
        bset.move(State.FAILED, error)
        self.pages.set_failed(bset)
        if not bset.holding_slots():
            if len(bset.told) == bset.npes:
                self._forget(bset)
            elif keep:  # keep the verdict for ranks that join late, then forget it
                self._timers.cancel(*bset.timers)
                until = (now if now is not None else bset.created) + 2 * max(self._waits.rendezvous, bset.patience)
                bset.timers[:] = [self._timers.at(until, lambda t, b=bset: self._forget(b))]
                self._keep_verdict(bset)
        return out

    def _keep_verdict(self, bset: BufferSet) -> None:
        """Count a kept verdict against its uid: past --max-groups-per-uid of them the oldest is forgotten
        (its late ranks then wait out a rendezvous of their own), so failing sets on purpose holds no
        memory and no per-request work beyond that share."""
        kept = self._verdicts.setdefault(bset.owner_uid, {})
        kept[bset.id] = bset
        share = self._quotas.limits.max_groups_per_uid
        while share is not None and len(kept) > share:
            oldest = next(iter(kept.values()))
            log.info("%s: its failure verdict is forgotten early: uid %s keeps more than %d", oldest.label,
                     oldest.owner_uid, share)
            self._forget(oldest)

    # ------------------------------------------------------------ commit and release

    def commit(self, caller: Caller, who: Credentials, req: dict[str, Any], now: float) -> Outbox:
        bset, error = self._member_set(req, who)
        if error:
            return [Send(caller, error=error)]
        if bset.state is State.JOINING:
            return [refuse(caller, ErrorCode.BAD_REQUEST, f"{bset.label} has not sent its handles yet")]
        on_page = req["page"]  # the rank voted on the set's page and had its verdict there: no answer here
        if on_page and not self.pages.holds(bset):
            return [refuse(caller, ErrorCode.BAD_REQUEST, f"{bset.label} has no control page to commit on")]
        if bset.commit.result is not None:
            return [] if on_page else [bset.commit.answer(caller)]
        if req["rank"] in bset.commit.votes:
            return [refuse(caller, ErrorCode.BAD_REQUEST, f"rank {req['rank']} already voted")]
        if not bset.commit.votes:
            timeout = req["timeout"] or self._waits.agreement
            timer = self._timers.at(now + timeout, lambda t, b=bset: self._commit_due(b, timeout))
            bset.commit.on_settle = lambda: self._timers.cancel(timer)
        by_message_on_page = req["ok"] and not on_page and self.pages.holds(bset)
        if by_message_on_page:
            self.pages.committed(bset, req["rank"])  # its peers that wait on the page count it too
        out = bset.commit.vote(req["rank"], req["ok"], req["reason"], None if on_page else caller)
        if bset.commit.result is None:
            if not req["ok"]:  # a no decides the set: fail fast, with its reason
                out += bset.commit.finish(False, bset.commit.reason)
            elif self.pages.commit_seen_agreed(bset):  # every rank voted yes there (a yes by message was just
                # written there); a yes the page does not confirm settles nothing (the looks or the timer do)
                out += bset.commit.finish(True, "")
            elif by_message_on_page:  # its caller waits: the round is settled on the page soon, looked at then
                self._look_at_commit_later(bset, now, COMMIT_LOOK_FIRST_S)
        self._settled(bset)
        return out

    def _look_at_commit_later(self, bset: BufferSet, now: float, wait: float) -> None:
        self._timers.at(now + wait, lambda t: self._look_at_commit(bset, t, wait))

    def _look_at_commit(self, bset: BufferSet, now: float, waited: float) -> Outbox:
        """An opening set whose commit round agreed on its page goes live; else look again later."""
        if bset.state is not State.OPENING or bset.commit.result is not None:
            return []
        if not self.pages.commit_seen_agreed(bset):
            self._look_at_commit_later(bset, now, min(2 * waited, COMMIT_LOOK_LONGEST_S))
            return []
        return self._agreed_on_page(bset)

    def _agreed_on_page(self, bset: BufferSet) -> Outbox:
        """Its commit round agreed on the page: the set goes live, and the ranks that voted through a
        message, if any, hear it."""
        out = bset.commit.finish(True, "")
        self._settled(bset)
        return out

    def _settled(self, bset: BufferSet) -> None:
        """The set's state once its commit round has a result."""
        if bset.commit.result is not None and bset.state is State.OPENING:
            ok, reason = bset.commit.result
            if ok:
                bset.move(State.LIVE)
                log.info("%s live: every rank mapped every peer", bset.label)
            else:
                bset.move(State.FAILED, ProtocolError(ErrorCode.GROUP_FAILED, reason))
                self.pages.set_failed(bset)
                log.warning("%s failed its agreement: %s", bset.label, reason)

    def _fail_opening(self, bset: BufferSet, code: ErrorCode, message: str, now: float | None = None) -> Outbox:
        """Fail a set whose handles went out and whose commit is open (it timed out, a rank died or
        left unheard), unless its commit round on the page agreed: the ranks went on with it, whether
        or not the daemon looked at the page yet, so it is live."""
        if not self.pages.commit_agreed(bset):
            return self._fail(bset, code, message, now=now)
        return self._agreed_on_page(bset)

    def _commit_due(self, bset: BufferSet, timeout: float) -> Outbox:
        if bset.commit is None or bset.commit.result is not None:
            return []
        missing = bset.commit.missing()
        message = (
            f"agreement of {bset.label} timed out after {timeout:g}s waiting for "
            f"{bset.who(missing)} to open every peer's handle"
        )
        return self._fail_opening(bset, ErrorCode.TIMEOUT, message)

    def release(self, caller: Caller, who: Credentials, req: dict[str, Any], now: float) -> Outbox:
        bset, error = self._member_set(req, who)
        if error:
            return [Send(caller, error=error)]
        slot, pid = bset.slots[req["rank"]], who.pid
        if bset.state is State.JOINING:
            message = f"rank {slot.rank} (pid {pid}) of {bset.label} withdrew before {bset.awaited()}"
            return self._fail(bset, ErrorCode.GROUP_FAILED, message, now=now) + [Send(caller, {"freed": True})]
        out: Outbox = []
        if bset.state is State.OPENING and slot.rank not in bset.commit.votes:
            message = f"rank {slot.rank} (pid {pid}) of {bset.label} released before it mapped its peers"
            out = self._fail_opening(bset, ErrorCode.GROUP_FAILED, message, now=now)
        return out + [Send(caller, {"freed": self._drop_hold(bset, slot, "released", now)})]

    def opened_set(self, req: dict[str, Any], who: Credentials) -> BufferSet:
        """The set whose handles went out in which ``pid`` holds ``rank``: the fd channel's check.

        Raises ProtocolError when there is none (NOT_MEMBER, NOT_FOUND, the set's failure).
        """
        bset, error = self._member_set(req, who)
        if error:
            raise error
        if bset.state not in (State.OPENING, State.LIVE):
            raise bset.failure or ProtocolError(ErrorCode.BAD_REQUEST, f"{bset.label} has not sent its handles yet")
        return bset

    def _member_set(self, req: dict[str, Any], who: Credentials) -> tuple[BufferSet | None, ProtocolError | None]:
        """The set of ``uid``'s namespace in which ``pid`` holds ``rank``, or why there is none.

        Retired sets count: see Note [Retired sets]. Without one, the key's
        current set says why: another pid holds the rank, or its kept verdict
        (see Note [Failure verdicts are kept]).
        """
        key, rank, pid, wanted = (who.uid, req["group"], req["name"]), req["rank"], who.pid, req.get("set")
        for bset in self.index.of_group(who.uid, req["group"]):
            if bset.name != req["name"] or wanted not in (None, bset.id):
                continue
            slot = bset.slots.get(rank)
            if slot is not None and slot.held and slot.pid == pid:
                return bset, None
        if wanted is not None:  # that set's hold already ended: a release delivered twice ends nothing else
            return None, ProtocolError(ErrorCode.NOT_FOUND, f"pid {pid} holds rank {rank} of no set {wanted} of "
                                                            f"group={key[1]} name={key[2]} (released already)")
        current = self.index.current.get(key)
        slot = current.slots.get(rank) if current else None
        if slot is not None and slot.held:
            return None, ProtocolError(
                ErrorCode.NOT_MEMBER,
                f"rank {rank} of group={key[1]} name={key[2]} belongs to pid {slot.pid}, not pid {pid}",
            )
        if current is not None and current.failure is not None:
            return None, current.failure
        return None, ProtocolError(
            ErrorCode.NOT_FOUND, f"pid {pid} holds no rank {rank} of group={key[1]} name={key[2]}"
        )

    def _drop_hold(self, bset: BufferSet, slot: Slot, why: str, left_at: float | None = None) -> bool:
        """Drop one rank's hold; free the set once nobody holds it. True if freed. A rank that left
        (``left_at``) aborts its peers' page only if they still hold the set LEAVE_GRACE_S later."""
        self.index.let_go(bset, slot)
        if left_at is None:
            self.pages.hold_dropped(bset, slot, why)
        else:
            bset.timers.append(self._timers.at(left_at + LEAVE_GRACE_S, lambda t: self._left_late(bset, slot, why)))
        holding = len(bset.holding_slots())
        log.debug("%s rank=%d pid=%d %s (%d still hold it)", bset.label, slot.rank, slot.pid, why, holding)
        if holding:
            return False
        self._free_set(bset)
        self._forget(bset)
        return True

    def _left_late(self, bset: BufferSet, slot: Slot, why: str) -> Outbox:
        """LEAVE_GRACE_S after a rank released a set its peers still hold (see Note [A leaving rank
        aborts late]): their page aborts, and the rank has left the group's agreement on the message
        path too, unless the rank is held in another set of the group (by this process, or by the one
        that took its place meanwhile)."""
        self.pages.hold_dropped(bset, slot, why)
        group, rank = bset.group, slot.rank
        if not bset.holding_slots() or self.index.pids_holding_rank(bset.owner_uid, group, rank):
            return []
        slot.left = f"rank {rank} (pid {slot.pid}) {why} {bset.label} while its peers still held it, and left the group"
        return self._left(bset.owner_uid, group, rank, slot.pid, slot.left)

    def _free_set(self, bset: BufferSet, mapped_by: Sequence[int] = ()) -> None:
        """Free every rank's buffer; ``mapped_by``: the live processes an eviction took the set from."""
        self.pages.set_freed(bset)  # its abort word is set before any memory goes
        for s in bset.slots.values():
            if s.allocation is not None:
                allocation, s.allocation = s.allocation, None
                self._quotas.charge(s.uid, allocation.device, -allocation.size)
                try:
                    self._free(allocation, mapped_by)
                except Exception:  # a failing driver must not strand the rest of the set
                    log.exception("%s: freeing rank %d's buffer failed", bset.label, s.rank)
        log.info("%s freed", bset.label)

    def _forget(self, bset: BufferSet) -> Outbox:
        """Drop a set nobody holds, and its timers."""
        if bset.holding_slots():
            return []
        self._timers.cancel(*bset.timers)
        bset.timers.clear()
        self.index.remove(bset)
        kept = self._verdicts.get(bset.owner_uid)
        if kept is not None and kept.pop(bset.id, None) is not None and not kept:
            del self._verdicts[bset.owner_uid]
        return []

    # ------------------------------------------------------------ by force, by death, by shutdown

    def evict(self, group: str, name: str | None, uid: int | None) -> tuple[Outbox, list[dict[str, Any]]]:
        """Free the group's sets by force, whoever holds them, and fail their waits (see Registry.evict)."""
        out: Outbox = []
        evicted = []
        for bset in self.index.all():
            if bset.group != group or (name is not None and bset.name != name):
                continue
            if uid is not None and bset.owner_uid != uid:
                continue
            holders = {str(s.rank): s.pid for s in bset.holding_slots()}
            # those that were handed the handles may map the memory until they exit: none of it goes to the
            # driver under them (peerd.arena: Note [No free under a mapping])
            mapped_by = list(holders.values()) if bset.commit is not None else []
            message = f"{bset.label} was evicted by an administrator"
            self.pages.evicted(bset)  # kernels polling the abort word stop before the memory is freed
            out += self._fail(bset, ErrorCode.GROUP_FAILED, message, keep=False)  # forgotten just below
            for slot in bset.slots.values():
                self.index.let_go(bset, slot)
            self._free_set(bset, mapped_by)
            self._forget(bset)
            if mapped_by:
                log.warning("%s of uid %s evicted; pids %s held it and may still touch its memory until they exit "
                            "(no other uid gets it before)", bset.label, bset.owner_uid, sorted(mapped_by))
            else:
                log.warning("%s of uid %s evicted before its handles went out", bset.label, bset.owner_uid)
            evicted.append({"group": bset.group, "name": bset.name, "uid": bset.owner_uid, "holders": holders})
        return out, evicted

    def process_died(self, pid: int, now: float) -> tuple[Outbox, set[RankKey]]:
        """Fail what waits on a dead process, drop its holds; the (group, rank)s it held, for tp_agree."""
        out: Outbox = []
        ranks: set[RankKey] = set()
        for bset in self.index.sets_of_pid(pid):
            for slot in list(bset.slots.values()):
                if slot.pid != pid or not slot.held:
                    continue
                if not ranks:
                    self.rank_deaths += 1
                ranks.add(((bset.owner_uid, bset.group), slot.rank))
                slot.dead = True
                message = f"rank {slot.rank} (pid {pid}) of {bset.label} died"
                if bset.state is State.JOINING:
                    slot.waiter = None
                    bset.told.add(slot.rank)  # the dead need no verdict
                    out += self._fail(bset, ErrorCode.RANK_DIED, f"{message} before {bset.awaited()}", now=now)
                    break
                if bset.state is State.OPENING and slot.rank not in bset.commit.votes:
                    out += self._fail_opening(bset, ErrorCode.RANK_DIED, message + " before it mapped its peers")
                self._drop_hold(bset, slot, "died")
        return out, ranks

    def drain(self) -> Outbox:
        """The daemon is stopping: fail every rendezvous still waiting; live sets may finish."""
        out: Outbox = []
        for bset in self.index.all():
            if bset.state is State.JOINING:
                out += self._fail(bset, ErrorCode.SHUTTING_DOWN, f"{bset.label}: the peerd daemon is shutting down")
        return out

    def shutdown(self, error: ProtocolError) -> Outbox:
        """Fail every wait with ``error`` and free every buffer: the daemon is going away."""
        out: Outbox = []
        for bset in self.index.all():
            for s in bset.slots.values():
                if s.waiter is not None:
                    out.append(Send(s.waiter, error=error))
                    s.waiter = None
                self.index.let_go(bset, s)
            if bset.commit is not None and bset.commit.result is None:
                out += [Send(c, error=error) for c in bset.commit.waiters.values()]
                bset.commit.waiters = {}
            self._free_set(bset)
        self.index.clear()
        self._verdicts.clear()
        return out
