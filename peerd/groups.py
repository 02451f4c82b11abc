"""The rules of rendezvous, agreement and release, as a pure state machine.

No sockets, no memory, no clock: every call takes ``now`` and returns an
outbox of ``Send``s, the replies the daemon must deliver. Memory is reached
only through the ``allocate`` and ``free`` callables given at construction, so
the unit tests drive every rule with fakes.

Who owns what (the memory note): the daemon allocates each rank's buffer when
that rank joins and is the only one that frees it. A rank *holds* the whole
buffer set from its join until its release or its death. Memory is freed
only when no rank holds the set any more, so a rank that exits can never pull
memory from under a peer's kernel. A set that fails before its handles went
out is freed at once: nobody can have mapped it.

Failure is reported to every waiting rank, never left to a hang: a mismatch,
an allocation failure, a timeout or a death fails the whole rendezvous or
agreement round, with a message naming the ranks and pids involved.

Every uid has its own key namespace: a buffer set is keyed by (owner uid,
group, name) and an agreement by (owner uid, group), so no user can block,
join or even see another user's group of the same name (root's workers join
root's namespace like anyone else). Only the administrators (root and the
daemon's uid) see every namespace, in ``listing`` and ``evict``.

Agreements are bounded: a rank may run at most ``MAX_RUN_AHEAD`` rounds ahead
of the slowest live member (a legitimate rank waits for each round), and one
uid may keep at most ``MAX_AGREEMENTS_PER_UID`` agreements and
``MAX_PENDING_ROUNDS_PER_UID`` unsettled rounds, so pipelined votes cost
linear time and bounded memory.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

from .backends.allocation import Allocation
from .protocol import ErrorCode, ProtocolError

log = logging.getLogger("peerd.groups")

#: How many rounds a rank may be ahead of the slowest live member of its
#: agreement; a legitimate rank waits for each round, so it is at most one ahead.
MAX_RUN_AHEAD = 8

#: Agreements one uid may keep at once (kept while any member lives).
MAX_AGREEMENTS_PER_UID = 1024

#: Agreement rounds one uid may keep unsettled at once, over all its agreements.
MAX_PENDING_ROUNDS_PER_UID = 1024

Caller = Hashable  # opaque to this module: the server's routing id and request id


@dataclass(frozen=True)
class Send:
    """One reply to deliver: a body, or an error."""

    caller: Caller
    body: dict[str, Any] | None = None
    error: ProtocolError | None = None


Outbox = list[Send]


def _fail(caller: Caller, code: ErrorCode, message: str) -> Send:
    return Send(caller, error=ProtocolError(code, message))


Allocate = Callable[[int, str, int, "int | None"], Allocation]  # (nbytes, device, flags, owner uid)
Free = Callable[[Allocation], None]


@dataclass(frozen=True)
class Limits:
    """What one caller may take; None is no limit. Checked before any allocation."""

    max_buffer_bytes: int | None = 16 << 30
    max_bytes_per_uid: int | None = None
    max_bytes_per_device: int | None = None
    max_groups: int | None = 4096
    max_ranks: int | None = 1024


class State(str, enum.Enum):
    JOINING = "joining"  # waiting for every rank to join
    OPENING = "opening"  # handles sent; waiting for every rank's commit vote
    LIVE = "live"  # every rank mapped every peer
    FAILED = "failed"  # failed; the reason is kept for ranks that ask later


# ---------------------------------------------------------------- agreement rounds


@dataclass
class Round:
    """One agreement round: every rank votes once, the result is the AND."""

    npes: int
    votes: dict[int, bool] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)
    waiters: dict[int, Caller] = field(default_factory=dict)
    result: tuple[bool, str] | None = None
    on_settle: Callable[[], None] | None = None  # cancels its timeout (and counts it settled)

    def vote(self, rank: int, ok: bool, reason: str, caller: Caller) -> Outbox:
        self.votes[rank] = ok
        if not ok:
            self.reasons.append(f"rank {rank}: {reason}" if reason else f"rank {rank} voted no")
        self.waiters[rank] = caller
        if len(self.votes) == self.npes:
            return self.finish(all(self.votes.values()), "; ".join(self.reasons))
        return []

    def missing(self) -> list[int]:
        return [r for r in range(self.npes) if r not in self.votes]

    def finish(self, ok: bool, reason: str) -> Outbox:
        """Settle the round and answer every waiter."""
        self.result = (ok, reason)
        self.abandon()
        waiters, self.waiters = self.waiters, {}
        return [Send(c, {"ok": ok, "reason": reason}) for c in waiters.values()]

    def abandon(self) -> None:
        """Settled, or nobody left to wait on it: drop its timeout."""
        if self.on_settle is not None:
            self.on_settle()
            self.on_settle = None

    def answer(self, caller: Caller) -> Send:
        assert self.result is not None
        ok, reason = self.result
        return Send(caller, {"ok": ok, "reason": reason})


@dataclass
class Agreement:
    """tp_agree's rounds for one group: the k-th call of each rank is round k."""

    group: str
    npes: int
    owner_uid: int | None
    pids: dict[int, int] = field(default_factory=dict)  # rank -> pid that votes for it
    calls: dict[int, int] = field(default_factory=dict)  # rank -> rounds entered
    rounds: dict[int, Round] = field(default_factory=dict)  # numbered without gaps from ``floor``
    dead: dict[int, int] = field(default_factory=dict)  # rank -> pid, died
    floor: int = 1  # the oldest round still kept

    @property
    def key(self) -> tuple[int | None, str]:
        return (self.owner_uid, self.group)

    def slowest(self) -> tuple[int, int]:
        """(rounds entered, rank) of the slowest live member; one not seen yet has entered none."""
        live = [(self.calls.get(r, 0), r) for r in range(self.npes) if r not in self.dead]
        return min(live, default=(max(self.calls.values(), default=0), -1))

    def collect(self) -> None:
        """Forget rounds every live rank has passed; a dead rank passes them all.

        Rounds are numbered without gaps, so only the oldest few are looked at
        and each is forgotten once: the cost is linear in the rounds played,
        however many a rank pipelines. With no round left every live rank has
        made the same number of calls, so the count starts again from zero:
        nothing grows while a group lives. The members stay known, so a rank
        that dies between rounds still fails the next round at once instead of
        leaving its peers to time out.
        """
        passed, _ = self.slowest()
        while self.floor <= passed and self.floor in self.rounds:
            if self.rounds[self.floor].result is None:
                break
            del self.rounds[self.floor]
            self.floor += 1
        if not self.rounds:
            self.calls.clear()
            self.floor = 1

    def finished(self) -> bool:
        """Every member it knew of is dead: nobody can still be waiting on it."""
        return set(self.pids) <= set(self.dead)


# ---------------------------------------------------------------- buffer sets


@dataclass
class Slot:
    rank: int
    pid: int
    uid: int | None
    device: str
    allocation: Allocation | None
    joined_at: float
    held: bool = True
    dead: bool = False  # its process died (which also dropped its hold)
    waiter: Caller | None = None  # the join reply still owed


@dataclass
class BufferSet:
    id: int
    group: str
    name: str
    npes: int
    nbytes: int
    flags: int
    created: float
    owner_uid: int | None  # the namespace it lives in: the uid of the ranks that join it
    state: State = State.JOINING
    slots: dict[int, Slot] = field(default_factory=dict)
    commit: Round | None = None
    failure: ProtocolError | None = None
    told: set[int] = field(default_factory=set)  # ranks that have heard the failure
    timers: list[int] = field(default_factory=list)  # its pending rendezvous or forget timers
    patience: float = 0.0  # the longest rendezvous timeout a rank asked for

    @property
    def label(self) -> str:
        return f"group={self.group} name={self.name}"

    @property
    def key(self) -> tuple[int | None, str, str]:
        return (self.owner_uid, self.group, self.name)

    def holders(self) -> list[Slot]:
        return [s for s in self.slots.values() if s.held]

    def missing(self) -> list[int]:
        return [r for r in range(self.npes) if r not in self.slots]

    def who(self, ranks: list[int] | None = None) -> str:
        slots = [self.slots[r] for r in (ranks if ranks is not None else sorted(self.slots))]
        return ", ".join(f"rank {s.rank} (pid {s.pid})" for s in slots) or "none"


class Registry:
    """Every buffer set and agreement the daemon knows, and the rules between them."""

    def __init__(
        self,
        allocate: Allocate,
        free: Free,
        rendezvous_timeout: float = 60.0,
        agreement_timeout: float = 60.0,
        limits: Limits = Limits(),
        admins: frozenset[int] = frozenset({0}),
    ):
        self._allocate = allocate
        self._free = free
        self.rendezvous_timeout = rendezvous_timeout
        self.agreement_timeout = agreement_timeout
        self.limits = limits
        self.admins = admins  # uids that see and evict every uid's groups
        self.rank_deaths = 0  # processes that died holding a rank of a buffer set
        self.bytes_by_uid: dict[int | None, int] = {}
        self.bytes_by_device: dict[str, int] = {}
        self.sets: dict[tuple[int | None, str, str], BufferSet] = {}  # the current set of each (uid, group, name)
        self.retired: dict[int, BufferSet] = {}  # superseded sets still held by some rank
        self._by_group: dict[tuple[int | None, str], dict[int, BufferSet]] = {}  # current and retired, by id
        self.agreements: dict[tuple[int | None, str], Agreement] = {}  # by (uid, group)
        self.agreements_by_uid: dict[int | None, int] = {}
        self.open_rounds_by_uid: dict[int | None, int] = {}  # agreement rounds not settled yet
        self._ids = itertools.count(1)
        self._timers: list[tuple[float, int]] = []  # heap of (deadline, timer id)
        self._checks: dict[int, Callable[[float], Outbox]] = {}  # live timers by id

    # ------------------------------------------------------------ timers

    def _at(self, deadline: float, check: Callable[[float], Outbox]) -> int:
        """Call check(now) at deadline, unless cancelled first; the timer's id."""
        timer = next(self._ids)
        heapq.heappush(self._timers, (deadline, timer))
        self._checks[timer] = check
        return timer

    def _cancel(self, *timers: int) -> None:
        """A wait ended: drop its timers, so nothing holds the objects they refer to."""
        for timer in timers:
            self._checks.pop(timer, None)
        if len(self._timers) > 64 + 2 * len(self._checks):  # mostly cancelled: compact
            self._timers = [entry for entry in self._timers if entry[1] in self._checks]
            heapq.heapify(self._timers)

    def next_deadline(self) -> float | None:
        """When expire() next has work."""
        while self._timers and self._timers[0][1] not in self._checks:
            heapq.heappop(self._timers)
        return self._timers[0][0] if self._timers else None

    def expire(self, now: float) -> Outbox:
        """Fail every wait whose deadline has passed."""
        out: Outbox = []
        while self._timers and self._timers[0][0] <= now:
            _, timer = heapq.heappop(self._timers)
            check = self._checks.pop(timer, None)
            if check is not None:
                out += check(now)
        return out

    # ------------------------------------------------------------ buffer sets

    def join(self, caller: Caller, pid: int, req: dict[str, Any], now: float, uid: int | None = None) -> Outbox:
        key = (uid, req["group"], req["name"])
        rank, npes = req["rank"], req["npes"]
        timeout = req["timeout"] or self.rendezvous_timeout
        if rank >= npes:
            return [_fail(caller, ErrorCode.RANK_INVALID, f"rank {rank} is out of range for npes={npes}")]
        refusal = self._shape_limits(req)
        if refusal:
            return [_fail(caller, ErrorCode.LIMIT_EXCEEDED, refusal)]
        bset = self.sets.get(key)
        if bset is not None and bset.state is State.FAILED and not bset.holders():
            bset.told.add(rank)
            out = [Send(caller, error=bset.failure)]
            if len(bset.told) == bset.npes:
                self._forget(bset)
            return out
        if bset is not None and bset.state is not State.JOINING:
            held = bset.slots.get(rank)
            if held is not None and held.held:
                return [
                    _fail(
                        caller,
                        ErrorCode.RANK_TAKEN,
                        f"rank {rank} of {bset.label} is still held by pid {held.pid}; "
                        "close that PeerBuffer first, or pass another name=",
                    )
                ]
            self._retire(bset)
            bset = None
        if bset is None:
            limit = self.limits.max_groups
            if limit is not None and self.counted_sets() >= limit:
                return [
                    _fail(caller, ErrorCode.LIMIT_EXCEEDED, f"the daemon already holds {limit} buffer sets "
                          f"(--max-groups {limit}); a new group={key[1]} name={key[2]} must wait for one to be freed")
                ]
            bset = self._new_set(key, npes, req["nbytes"], req["flags"], now)
        else:
            problem = self._mismatch(bset, req)
            if problem:
                bset.told.add(rank)
                return self._fail_set(bset, ErrorCode.MISMATCH, problem, [caller], now=now)
            taken = bset.slots.get(rank)
            if taken is not None:
                return [
                    _fail(
                        caller,
                        ErrorCode.RANK_TAKEN,
                        f"rank {rank} of {bset.label} was already joined by pid {taken.pid}",
                    )
                ]
        refusal = self._usage_limits(bset.nbytes, uid, req["device"])
        if refusal:
            bset.told.add(rank)
            message = f"rank {rank} (pid {pid}): {refusal}"
            return self._fail_set(bset, ErrorCode.LIMIT_EXCEEDED, message, [caller], now=now)
        try:
            allocation = self._allocate(bset.nbytes, req["device"], bset.flags, bset.owner_uid)
        except ProtocolError as err:
            bset.told.add(rank)
            return self._fail_set(bset, err.code, f"rank {rank} (pid {pid}): {err.message}", [caller], now=now)
        self._account(uid, allocation.device, allocation.size)
        bset.slots[rank] = Slot(rank, pid, uid, req["device"], allocation, now, waiter=caller)
        bset.patience = max(bset.patience, timeout)
        log.info(
            "%s rank=%d pid=%d joined (%d/%d) device=%s",
            bset.label, rank, pid, len(bset.slots), npes, req["device"],
        )
        if len(bset.slots) < npes:
            bset.timers.append(self._at(now + timeout, lambda t, b=bset: self._rendezvous_due(b, t)))
            return []
        return self._open(bset, now)

    def withdraw(self, caller: Caller, pid: int, req: dict[str, Any], now: float, uid: int | None = None) -> Outbox:
        """A rank that cannot take part: every rank waiting fails now, ranks still to come on arrival.

        The verdict is a failed set like any other (its rendezvous had no
        memory yet), kept as a failed rendezvous's is; see ``_fail_set``.
        """
        key = (uid, req["group"], req["name"])
        rank, npes = req["rank"], req["npes"]
        if rank >= npes:
            return [_fail(caller, ErrorCode.RANK_INVALID, f"rank {rank} is out of range for npes={npes}")]
        message = f"rank {rank} (pid {pid}) of group={key[1]} name={key[2]} cannot take part: {req['reason']}"
        bset = self.sets.get(key)
        if bset is not None and bset.state is not State.JOINING:
            held = bset.slots.get(rank)
            if held is not None and held.held:
                return [_fail(caller, ErrorCode.RANK_TAKEN, f"rank {rank} of {bset.label} is still held by pid {held.pid}")]
            self._retire(bset)
            bset = None
        if bset is None:
            limit = self.limits.max_groups
            if limit is not None and sum(b.owner_uid == uid for b in self.sets.values()) >= limit:
                return [Send(caller, {})]  # no room to keep the verdict: the others time out instead
            bset = self._new_set(key, npes, 0, 0, now)
        bset.told.add(rank)
        return self._fail_set(bset, ErrorCode.GROUP_FAILED, message, now=now) + [Send(caller, {})]

    def _new_set(self, key: tuple[int | None, str, str], npes: int, nbytes: int, flags: int, now: float) -> BufferSet:
        """A rendezvous for ``key``, now the key's current set."""
        bset = BufferSet(next(self._ids), key[1], key[2], npes, nbytes, flags, now, key[0])
        self.sets[key] = bset
        self._by_group.setdefault((key[0], bset.group), {})[bset.id] = bset
        return bset

    def _shape_limits(self, req: dict[str, Any]) -> str | None:
        """A request too big whoever asks: more ranks or a bigger buffer than allowed."""
        lim = self.limits
        if lim.max_ranks is not None and req["npes"] > lim.max_ranks:
            return f"npes={req['npes']} exceeds the daemon's limit of {lim.max_ranks} ranks per group (--max-ranks)"
        if lim.max_buffer_bytes is not None and req["nbytes"] > lim.max_buffer_bytes:
            return (f"nbytes={req['nbytes']} exceeds the daemon's limit of {lim.max_buffer_bytes} bytes "
                    "per buffer (--max-buffer-bytes)")
        return None

    def _usage_limits(self, nbytes: int, uid: int | None, device: str) -> str | None:
        """A request that would take one uid or one device past its share."""
        lim = self.limits
        held = self.bytes_by_uid.get(uid, 0)
        if lim.max_bytes_per_uid is not None and held + nbytes > lim.max_bytes_per_uid:
            return (f"uid {uid} holds {held} bytes and asks for {nbytes} more, over its limit of "
                    f"{lim.max_bytes_per_uid} bytes (--max-bytes-per-uid)")
        held = self.bytes_by_device.get(device, 0)
        if lim.max_bytes_per_device is not None and held + nbytes > lim.max_bytes_per_device:
            return (f"device {device} holds {held} bytes and {nbytes} more were asked, over its limit of "
                    f"{lim.max_bytes_per_device} bytes (--max-bytes-per-device)")
        return None

    def _account(self, uid: int | None, device: str, size: int) -> None:
        self._count(self.bytes_by_uid, uid, size)
        self._count(self.bytes_by_device, device, size)

    @staticmethod
    def _count(table: dict, key: Any, delta: int) -> None:
        """Add to a tally; a key that reaches zero leaves the table, so nothing grows."""
        table[key] = table.get(key, 0) + delta
        if not table[key]:
            del table[key]

    @staticmethod
    def _mismatch(bset: BufferSet, req: dict[str, Any]) -> str | None:
        diffs = [
            f"{what}={req[what]} but {bset.who()} joined with {what}={have}"
            for what, have in (("npes", bset.npes), ("nbytes", bset.nbytes), ("flags", bset.flags))
            if req[what] != have
        ]
        if diffs:
            return f"rank {req['rank']} of {bset.label} asked for " + "; ".join(diffs)
        return None

    def _open(self, bset: BufferSet, now: float) -> Outbox:
        """Every rank joined: hand every rank every rank's handle in one reply."""
        bset.state = State.OPENING
        self._cancel(*bset.timers)
        bset.timers.clear()
        bset.commit = Round(bset.npes)
        slots = [bset.slots[r] for r in range(bset.npes)]
        body = {
            "backend": slots[0].allocation.backend,
            "handles": [s.allocation.handle for s in slots],
            "sizes": [s.allocation.size for s in slots],
            "devices": [s.device for s in slots],
        }
        log.info("%s ready: handles sent to %d ranks", bset.label, bset.npes)
        out = []
        for s in slots:
            out.append(Send(s.waiter, body))
            s.waiter = None
        return out

    def _rendezvous_due(self, bset: BufferSet, now: float) -> Outbox:
        if bset.state is not State.JOINING:
            return []
        waited = now - min(s.joined_at for s in bset.slots.values())
        message = (
            f"rendezvous of {bset.label} timed out after {waited:.1f}s: "
            f"rank(s) {bset.missing()} of {bset.npes} never joined (joined: {bset.who()})"
        )
        return self._fail_set(bset, ErrorCode.TIMEOUT, message, now=now)

    def _fail_set(
        self, bset: BufferSet, code: ErrorCode, message: str, extra: list[Caller] = (), now: float | None = None
    ) -> Outbox:
        """Fail a set for every rank waiting on it (and ``extra`` callers)."""
        error = ProtocolError(code, message)
        log.warning("%s failed: %s", bset.label, message)
        out = [Send(c, error=error) for c in extra]
        if bset.state is State.JOINING:
            # nobody has the handles yet, so nobody can have mapped the memory
            for s in bset.slots.values():
                if s.waiter is not None:
                    out.append(Send(s.waiter, error=error))
                    bset.told.add(s.rank)
                s.waiter, s.held = None, False
            self._free_set(bset)
        elif bset.commit is not None and bset.commit.result is None:
            out += bset.commit.finish(False, message)
        bset.state, bset.failure = State.FAILED, error
        if not bset.holders():
            if len(bset.told) == bset.npes:
                self._forget(bset)
            else:  # keep the verdict for ranks that join late, then forget it
                self._cancel(*bset.timers)
                keep = (now if now is not None else bset.created) + 2 * max(self.rendezvous_timeout, bset.patience)
                bset.timers[:] = [self._at(keep, lambda t, b=bset: self._forget(b))]
        return out

    def commit(self, caller: Caller, pid: int, req: dict[str, Any], now: float, uid: int | None = None) -> Outbox:
        bset, error = self._member_set(req, pid, uid)
        if error:
            return [Send(caller, error=error)]
        if bset.state is State.JOINING:
            return [_fail(caller, ErrorCode.BAD_REQUEST, f"{bset.label} has not sent its handles yet")]
        if bset.commit.result is not None:
            return [bset.commit.answer(caller)]
        if req["rank"] in bset.commit.votes:
            return [_fail(caller, ErrorCode.BAD_REQUEST, f"rank {req['rank']} already voted")]
        if not bset.commit.votes:
            timeout = req["timeout"] or self.agreement_timeout
            timer = self._at(now + timeout, lambda t, b=bset: self._commit_due(b, t, timeout))
            bset.commit.on_settle = lambda: self._cancel(timer)
        out = bset.commit.vote(req["rank"], req["ok"], req["reason"], caller)
        if bset.commit.result is not None:
            ok, reason = bset.commit.result
            if ok:
                bset.state = State.LIVE
                log.info("%s live: every rank mapped every peer", bset.label)
            else:
                bset.state, bset.failure = State.FAILED, ProtocolError(ErrorCode.GROUP_FAILED, reason)
                log.warning("%s failed its agreement: %s", bset.label, reason)
        return out

    def _commit_due(self, bset: BufferSet, now: float, timeout: float) -> Outbox:
        if bset.commit is None or bset.commit.result is not None:
            return []
        missing = bset.commit.missing()
        message = (
            f"agreement of {bset.label} timed out after {timeout:g}s waiting for "
            f"{bset.who(missing)} to open every peer's handle"
        )
        return self._fail_set(bset, ErrorCode.TIMEOUT, message)

    def release(self, caller: Caller, pid: int, req: dict[str, Any], now: float, uid: int | None = None) -> Outbox:
        bset, error = self._member_set(req, pid, uid)
        if error:
            return [Send(caller, error=error)]
        slot = bset.slots[req["rank"]]
        if bset.state is State.JOINING:
            message = f"rank {slot.rank} (pid {pid}) of {bset.label} withdrew before every rank joined"
            return self._fail_set(bset, ErrorCode.GROUP_FAILED, message, now=now) + [Send(caller, {"freed": True})]
        out: Outbox = []
        if bset.state is State.OPENING and slot.rank not in bset.commit.votes:
            message = f"rank {slot.rank} (pid {pid}) of {bset.label} released before it mapped its peers"
            out = self._fail_set(bset, ErrorCode.GROUP_FAILED, message, now=now)
        return out + [Send(caller, {"freed": self._drop_hold(bset, slot, "released")})]

    def opened_set(self, req: dict[str, Any], pid: int, uid: int | None = None) -> BufferSet:
        """The set whose handles went out in which ``pid`` holds ``rank``: the fd channel's check.

        Raises ProtocolError when there is none (NOT_MEMBER, NOT_FOUND, the set's failure).
        """
        bset, error = self._member_set(req, pid, uid)
        if error:
            raise error
        if bset.state not in (State.OPENING, State.LIVE):
            raise bset.failure or ProtocolError(ErrorCode.BAD_REQUEST, f"{bset.label} has not sent its handles yet")
        return bset

    def _member_set(
        self, req: dict[str, Any], pid: int, uid: int | None
    ) -> tuple[BufferSet | None, ProtocolError | None]:
        """The set of ``uid``'s namespace in which ``pid`` holds ``rank``, or why there is none."""
        key, rank = (uid, req["group"], req["name"]), req["rank"]
        for bset in self._group_sets(uid, req["group"]):
            if bset.name != req["name"]:
                continue
            slot = bset.slots.get(rank)
            if slot is not None and slot.held and slot.pid == pid:
                return bset, None
        current = self.sets.get(key)
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

    def _drop_hold(self, bset: BufferSet, slot: Slot, why: str) -> bool:
        """Drop one rank's hold; free the set once nobody holds it. True if freed."""
        slot.held = False
        log.info("%s rank=%d pid=%d %s (%d still hold it)", bset.label, slot.rank, slot.pid, why, len(bset.holders()))
        if bset.holders():
            return False
        self._free_set(bset)
        self._forget(bset)
        return True

    def _free_set(self, bset: BufferSet) -> None:
        for s in bset.slots.values():
            if s.allocation is not None:
                allocation, s.allocation = s.allocation, None
                self._account(s.uid, allocation.device, -allocation.size)
                try:
                    self._free(allocation)
                except Exception:  # a failing driver must not strand the rest of the set
                    log.exception("%s: freeing rank %d's buffer failed", bset.label, s.rank)
        log.info("%s freed", bset.label)

    def _retire(self, bset: BufferSet) -> None:
        """A new set takes the key; the old one lives until its last holder lets go."""
        del self.sets[bset.key]
        if bset.holders():
            self.retired[bset.id] = bset
        else:
            self._unindex(bset)

    def _unindex(self, bset: BufferSet) -> None:
        named = self._by_group.get((bset.owner_uid, bset.group), {})
        named.pop(bset.id, None)
        if not named:
            self._by_group.pop((bset.owner_uid, bset.group), None)

    def _group_sets(self, uid: int | None, group: str) -> list[BufferSet]:
        """Every set, current or retired, of one group of one uid's namespace."""
        return list(self._by_group.get((uid, group), {}).values())

    def _forget(self, bset: BufferSet) -> Outbox:
        """Drop a set nobody holds, and its timers."""
        if bset.holders():
            return []
        self._cancel(*bset.timers)
        bset.timers.clear()
        if self.sets.get(bset.key) is bset:
            del self.sets[bset.key]
        self.retired.pop(bset.id, None)
        self._unindex(bset)
        return []

    # ------------------------------------------------------------ tp_agree

    def agree(self, caller: Caller, pid: int, req: dict[str, Any], now: float, uid: int | None = None) -> Outbox:
        group, rank, npes = req["group"], req["rank"], req["npes"]
        key = (uid, group)
        if rank >= npes:
            return [_fail(caller, ErrorCode.RANK_INVALID, f"rank {rank} is out of range for npes={npes}")]
        holders = self._rank_holders(uid, group, rank)
        if holders and pid not in holders:
            return [_fail(caller, ErrorCode.NOT_MEMBER, f"rank {rank} of group={group} is held by pid "
                          f"{', '.join(map(str, sorted(holders)))} (a buffer set of it), not pid {pid}: "
                          "only the process holding a rank may vote for it")]
        agreement = self.agreements.get(key)
        out: Outbox = []
        if agreement is not None and agreement.dead.get(rank, pid) != pid:
            # a new process takes a dead rank's place: the old rounds are over
            reason = self._deaths(agreement, [rank]) + f"; pid {pid} took its place"
            for rnd in agreement.rounds.values():
                if rnd.result is None:
                    out += rnd.finish(False, reason)
            self._drop_agreement(agreement)
            agreement = None
        if agreement is None:
            kept = self.agreements_by_uid.get(uid, 0)
            if kept >= MAX_AGREEMENTS_PER_UID:
                return out + [_fail(caller, ErrorCode.LIMIT_EXCEEDED, f"uid {uid} already keeps {kept} agreements "
                                    f"(at most {MAX_AGREEMENTS_PER_UID}); group={group} must wait until the "
                                    "processes of another one exit")]
            agreement = self.agreements[key] = Agreement(group, npes, uid)
            self._count(self.agreements_by_uid, uid, 1)
            # ranks of this group that died holding a buffer set are members too
            for bset in self._group_sets(uid, group):
                for slot in bset.slots.values():
                    if slot.dead and slot.rank != rank and slot.rank < npes:
                        agreement.pids[slot.rank] = agreement.dead[slot.rank] = slot.pid
        if agreement.npes != npes:
            return out + [
                _fail(
                    caller,
                    ErrorCode.MISMATCH,
                    f"rank {rank} of group={group} agrees with npes={npes} but the group has npes={agreement.npes}",
                )
            ]
        owner = agreement.pids.setdefault(rank, pid)
        if owner != pid:
            return out + [
                _fail(caller, ErrorCode.NOT_MEMBER, f"rank {rank} of group={group} votes from pid {owner}, not {pid}")
            ]
        k = agreement.calls.get(rank, 0) + 1
        rnd = agreement.rounds.get(k)
        if rnd is None:
            refusal = self._round_limits(agreement, rank, k)
            if refusal:
                return out + [_fail(caller, ErrorCode.LIMIT_EXCEEDED, refusal)]
            rnd = agreement.rounds[k] = Round(npes)
            timeout = req["timeout"] or self.agreement_timeout
            rnd.on_settle = self._open_round(
                uid, now + timeout, lambda t, a=agreement, k=k: self._round_due(a, k, timeout)
            )
        agreement.calls[rank] = k
        settled = rnd.result is not None
        if settled:
            out.append(rnd.answer(caller))
        else:
            out += rnd.vote(rank, req["ok"], "", caller)
            dead = [r for r in rnd.missing() if r in agreement.dead]
            if dead and rnd.result is None:
                out += rnd.finish(False, self._deaths(agreement, dead))
        if not settled and rnd.result is not None and not rnd.result[0]:
            log.warning("group=%s agreement round %d: False (%s)", group, k, rnd.result[1])
        self._collect(agreement)
        return out

    def _open_round(self, uid: int | None, deadline: float, check: Callable[[float], Outbox]) -> Callable[[], None]:
        """Count one more round open for ``uid`` and time it; what to call once it settles."""
        timer = self._at(deadline, check)
        self._count(self.open_rounds_by_uid, uid, 1)

        def settled() -> None:
            self._cancel(timer)
            self._count(self.open_rounds_by_uid, uid, -1)

        return settled

    def _round_limits(self, agreement: Agreement, rank: int, k: int) -> str | None:
        """Why ``rank`` may not open round ``k``: too far ahead, or its uid keeps too many rounds open."""
        behind, slowest = agreement.slowest()
        if k - behind > MAX_RUN_AHEAD:
            return (f"rank {rank} of group={agreement.group} would open round {k} while rank {slowest} "
                    f"(pid {agreement.pids.get(slowest, 'not seen yet')}) has entered {behind}: a rank may run at "
                    f"most {MAX_RUN_AHEAD} rounds ahead; wait for each round's verdict before voting again")
        open_rounds = self.open_rounds_by_uid.get(agreement.owner_uid, 0)
        if open_rounds >= MAX_PENDING_ROUNDS_PER_UID:
            return (f"uid {agreement.owner_uid} already keeps {open_rounds} agreement rounds unsettled "
                    f"(at most {MAX_PENDING_ROUNDS_PER_UID}); wait for them to settle")
        return None

    def _drop_agreement(self, agreement: Agreement) -> None:
        if self.agreements.get(agreement.key) is agreement:
            del self.agreements[agreement.key]
            self._count(self.agreements_by_uid, agreement.owner_uid, -1)
            for rnd in agreement.rounds.values():
                rnd.abandon()

    def _rank_holders(self, uid: int | None, group: str, rank: int) -> set[int]:
        """Pids holding ``rank`` in a live buffer set of the group: the only ones who may vote for it."""
        return {
            slot.pid
            for bset in self._group_sets(uid, group)
            if (slot := bset.slots.get(rank)) is not None and slot.held and not slot.dead
        }

    @staticmethod
    def _deaths(agreement: Agreement, ranks: list[int]) -> str:
        return "; ".join(f"rank {r} (pid {agreement.dead[r]}) died" for r in ranks)

    def _round_due(self, agreement: Agreement, k: int, timeout: float) -> Outbox:
        rnd = agreement.rounds.get(k)
        if rnd is None or rnd.result is not None:
            return []
        reason = (
            f"agreement round {k} of group={agreement.group} timed out after {timeout:g}s "
            f"waiting for rank(s) {rnd.missing()}"
        )
        log.warning("%s", reason)
        out = rnd.finish(False, reason)
        self._collect(agreement)
        return out

    def _collect(self, agreement: Agreement) -> None:
        agreement.collect()
        if agreement.finished():
            self._drop_agreement(agreement)

    # ------------------------------------------------------------ eviction

    def evict(self, group: str, name: str | None, uid: int | None = None) -> tuple[Outbox, list[dict[str, Any]]]:
        """Free a group's buffer sets by force, whoever holds them; fail its waits.

        Every uid's group of that key is evicted, unless ``uid`` narrows it to
        one namespace. The holders' kernels may still touch the memory: an
        operator's last resort for a group stuck behind a process that will
        not let go.
        """
        out: Outbox = []
        evicted = []
        for bset in self.all_sets():
            if bset.group != group or (name is not None and bset.name != name):
                continue
            if uid is not None and bset.owner_uid != uid:
                continue
            holders = {str(s.rank): s.pid for s in bset.holders()}
            message = f"{bset.label} was evicted by an administrator"
            out += self._fail_set(bset, ErrorCode.GROUP_FAILED, message)
            for slot in bset.slots.values():
                slot.held = False
            self._free_set(bset)
            self._forget(bset)
            self.sets.pop(bset.key, None)
            log.warning("%s of uid %s evicted; pids %s held it and may still touch the freed memory",
                        bset.label, bset.owner_uid, sorted(holders.values()))
            evicted.append({"group": bset.group, "name": bset.name, "uid": bset.owner_uid, "holders": holders})
        for agreement in list(self.agreements.values()):
            if agreement.group != group or (uid is not None and agreement.owner_uid != uid):
                continue
            self._drop_agreement(agreement)
            for rnd in agreement.rounds.values():
                if rnd.result is None:
                    out += rnd.finish(False, f"group={group} was evicted by an administrator")
        return out, evicted

    # ------------------------------------------------------------ liveness and shutdown

    def process_died(self, pid: int, now: float) -> Outbox:
        """A client process is gone: fail what waits on it, drop what it held."""
        out: Outbox = []
        ranks: set[tuple[tuple[int | None, str], int]] = set()  # ((uid, group), rank) the process held
        for bset in self.all_sets():
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
                    out += self._fail_set(bset, ErrorCode.RANK_DIED, message + " before every rank joined", now=now)
                    break
                if bset.state is State.OPENING and slot.rank not in bset.commit.votes:
                    out += self._fail_set(bset, ErrorCode.RANK_DIED, message + " before it mapped its peers")
                self._drop_hold(bset, slot, "died")
        for agreement in list(self.agreements.values()):
            ranks |= {(agreement.key, r) for r, owner in agreement.pids.items() if owner == pid}
        for key, rank in ranks:
            agreement = self.agreements.get(key)
            if agreement is not None and agreement.pids.get(rank, pid) == pid:
                out += self._rank_died(agreement, rank, pid)
        return out

    def _rank_died(self, agreement: Agreement, rank: int, pid: int) -> Outbox:
        """Every pending round the dead rank has not voted in is False now."""
        agreement.pids[rank] = agreement.dead[rank] = pid
        out: Outbox = []
        for rnd in agreement.rounds.values():
            if rnd.result is None and rank not in rnd.votes:
                out += rnd.finish(False, self._deaths(agreement, [rank]))
        # a member that exits between rounds is the normal end of a job, not news
        log.log(logging.WARNING if out else logging.DEBUG, "group=%s rank=%d pid=%d died%s", agreement.group,
                rank, pid, " while its peers waited in an agreement" if out else "")
        self._collect(agreement)
        return out

    def drain(self) -> Outbox:
        """The daemon is stopping: fail every rendezvous still waiting; live sets may finish."""
        out: Outbox = []
        for bset in self.all_sets():
            if bset.state is State.JOINING:
                out += self._fail_set(bset, ErrorCode.SHUTTING_DOWN, f"{bset.label}: the peerd daemon is shutting down")
        return out

    def counted_sets(self) -> int:
        """Buffer sets that count against --max-groups: all but failed ones nobody holds."""
        return sum(b.state is not State.FAILED or bool(b.holders()) for b in self.all_sets())

    def ranks_held(self) -> int:
        return sum(len(b.holders()) for b in self.all_sets())

    def held(self) -> int:
        """Buffer sets some rank still holds."""
        return sum(1 for b in self.all_sets() if b.holders())

    def shutdown(self) -> Outbox:
        """Fail every wait, free every buffer: the daemon is going away."""
        error = ProtocolError(ErrorCode.SHUTTING_DOWN, "the peerd daemon is shutting down")
        out: Outbox = []
        for bset in self.all_sets():
            for s in bset.slots.values():
                if s.waiter is not None:
                    out.append(Send(s.waiter, error=error))
                    s.waiter = None
                s.held = False
            if bset.commit is not None and bset.commit.result is None:
                waiters = bset.commit.waiters.values()
                out += [Send(c, error=error) for c in waiters]
                bset.commit.waiters = {}
            self._free_set(bset)
        for agreement in self.agreements.values():
            for rnd in agreement.rounds.values():
                out += [Send(c, error=error) for c in rnd.waiters.values()]
        self.sets.clear()
        self.retired.clear()
        self._by_group.clear()
        self.agreements.clear()
        self.agreements_by_uid.clear()
        self.open_rounds_by_uid.clear()
        self._timers.clear()
        self._checks.clear()
        return out

    # ------------------------------------------------------------ inspection

    def all_sets(self) -> list[BufferSet]:
        return list(self.sets.values()) + list(self.retired.values())

    def listing(self, now: float, uid: int | None) -> list[dict[str, Any]]:
        """What `peerd ls` shows ``uid``: one entry per buffer set of its namespace
        (of every namespace for an administrator), sorted by group, name and uid."""
        every = uid in self.admins
        shown = [b for b in self.all_sets() if every or b.owner_uid == uid]
        shown.sort(key=lambda b: (b.group, b.name, -1 if b.owner_uid is None else b.owner_uid, b.id))
        return [
            {
                "group": b.group,
                "uid": b.owner_uid,
                "name": b.name,
                "state": b.state.value,
                "npes": b.npes,
                "joined": sorted(b.slots),
                "held": sorted(s.rank for s in b.holders()),
                "pids": {str(r): s.pid for r, s in sorted(b.slots.items())},
                "nbytes": b.nbytes,
                "bytes_allocated": sum(s.allocation.size for s in b.slots.values() if s.allocation),
                "age_s": round(now - b.created, 3),
                "failure": b.failure.message if b.failure else None,
            }
            for b in shown
        ]
