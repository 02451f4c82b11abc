"""Buffer sets, their slots and their states, and the index that finds them.

A buffer set is one rendezvous of ``npes`` ranks under one key: each rank's
slot holds its pid and its buffer. Every uid has its own key namespace: a set
is keyed by (owner uid, group, name), so no user can block, join or even see
another user's group of the same name (root's workers join root's namespace
like anyone else).

A set's state changes only through ``BufferSet.move``, which checks it
against ``TRANSITIONS``: an illegal change is a bug in the rules and raises.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from .backends.allocation import Allocation
from .index import Index
from .outbox import Caller
from .protocol import ProtocolError
from .rounds import Round


RankKey = tuple[tuple["int | None", str], int]  # ((owner uid, group), rank): a rank of a group


class State(str, enum.Enum):
    JOINING = "joining"  # waiting for every rank to join
    OPENING = "opening"  # handles sent; waiting for every rank's commit vote
    LIVE = "live"  # every rank mapped every peer
    FAILED = "failed"  # failed; the reason is kept for ranks that ask later


#: The state changes a buffer set may make. A failed set may fail again: an
#: administrator evicts it, and the eviction is the verdict its holders hear.
TRANSITIONS: dict[State, frozenset[State]] = {
    State.JOINING: frozenset({State.OPENING, State.FAILED}),
    State.OPENING: frozenset({State.LIVE, State.FAILED}),
    State.LIVE: frozenset({State.FAILED}),
    State.FAILED: frozenset({State.FAILED}),
}


class IllegalTransition(RuntimeError):
    """A rule tried a state change the life of a buffer set does not have."""


@dataclass
class Slot:
    """One rank's place in a set: who joined it and the buffer allocated for it."""

    rank: int
    pid: int
    uid: int | None
    device: str
    allocation: Allocation | None
    joined_at: float
    held: bool = True  # its rank holds the set, from its join until its release or death
    dead: bool = False  # its process died (which also dropped its hold)
    waiter: Caller | None = None  # the join reply still owed
    own_pid: list | None = None  # [pid namespace, pid] as the rank claims them (peerd_client.stoppedpeers)
    left: str | None = None  # why its rank left the group: it released the set, and its peers held it on


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
    took_part: set[int] = field(default_factory=set)  # pids that were refused by it, withdrew or heard its
    # verdict (its slots name those that joined): a kept verdict is for their job, not for a relaunch
    timers: list[int] = field(default_factory=list)  # its pending rendezvous or forget timers
    patience: float = 0.0  # the longest rendezvous timeout a rank asked for
    claimed_again: dict[int, int] = field(default_factory=dict)  # rank -> the last other pid that asked for it

    @property
    def label(self) -> str:
        return f"group={self.group} name={self.name}"

    @property
    def key(self) -> tuple[int | None, str, str]:
        return (self.owner_uid, self.group, self.name)

    def awaited(self) -> str:
        """What a joining set waits for, as in "died before ...": its ranks, or once all joined, its memory
        (a backend may reserve it off the daemon's loop)."""
        return "its set's memory was ready" if len(self.slots) == self.npes else "every rank joined"

    def heard(self, rank: int, pid: int) -> None:
        """``rank`` (process ``pid``) has heard the verdict; a rank outside the set (a join that disagreed on
        npes) is none of the ranks its verdict is kept for."""
        self.took_part.add(pid)
        if rank < self.npes:
            self.told.add(rank)

    def move(self, to: State, failure: ProtocolError | None = None) -> None:
        """Change state, if the life of a set allows it; a failed set keeps ``failure`` as its verdict."""
        if to not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"{self.label}: {self.state.value} -> {to.value}")
        if (to is State.FAILED) != (failure is not None):
            raise IllegalTransition(f"{self.label}: a set fails with a verdict, and only a failed set has one")
        self.state = to
        if failure is not None:
            self.failure = failure

    def holding_slots(self) -> list[Slot]:
        """The slots whose rank still holds the set: while there is one, its memory stays."""
        return [s for s in self.slots.values() if s.held]

    def participants(self) -> set[int]:
        """Every pid that joined it, was refused by it, withdrew from it or heard its verdict."""
        return self.took_part | {s.pid for s in self.slots.values()}

    def missing(self) -> list[int]:
        return [r for r in range(self.npes) if r not in self.slots]

    def who(self, ranks: list[int] | None = None) -> str:
        slots = [self.slots[r] for r in (ranks if ranks is not None else sorted(self.slots))]
        return ", ".join(f"rank {s.rank} (pid {s.pid})" for s in slots) or "none"

    def mismatch(self, req: dict[str, Any]) -> str | None:
        """Why a join does not fit the ranks that joined first (npes, nbytes, flags), or None."""
        diffs = [
            f"{what}={req[what]} but {self.who()} joined with {what}={have}"
            for what, have in (("npes", self.npes), ("nbytes", self.nbytes), ("flags", self.flags))
            if req[what] != have
        ]
        return f"rank {req['rank']} of {self.label} asked for " + "; ".join(diffs) if diffs else None


# Note [Retired sets]
# ~~~~~~~~~~~~~~~~~~~
# A key has at most one current set. A new rendezvous of a key whose previous
# set some rank still holds (a rank released and starts over while its peers
# still map the old buffers) retires the old set: it leaves the key, so the
# new rendezvous can take it, but lives on in ``retired`` until its last
# holder lets go, and only then is its memory freed. A retired set is still a
# set of its group: a member's release, commit or fd request finds the set it
# names (the join reply's ``set``), else the one in which that pid holds the
# rank, current or retired, and a rank of a retired set still votes for its
# group in tp_agree. A process may not join the new rendezvous as a rank it
# still holds in a retired set of the key (RANK_TAKEN, as for the current
# set's holder): it would hold the rank twice over one key.


class SetIndex:
    """Every buffer set: the current one of each key, the retired ones, and both by group.

    See Note [Retired sets].
    """

    def __init__(self) -> None:
        self.current: dict[tuple[int | None, str, str], BufferSet] = {}  # the current set of each (uid, group, name)
        self.retired: dict[int, BufferSet] = {}  # superseded sets still held by some rank
        self._by_group: dict[tuple[int | None, str], dict[int, BufferSet]] = {}  # current and retired, by id
        self._of_uid: Index[int | None, int, BufferSet] = Index()  # sets of each uid, current and retired, as
        # they come and go: a new set's limit check, or a user's `ls`, costs nothing for other users' sets
        self.ranks_held = 0  # ranks holding a set, over every set; kept as slots are taken and let go,
        self.sets_held = 0  # and the sets some rank holds: `peerd status` reads them, never a walk
        self._of_pid: Index[int, int, BufferSet] = Index()  # pid -> the sets it has a slot in, by id: a death
        # looks at those alone

    def add(self, bset: BufferSet) -> None:
        """``bset`` is its key's current set now."""
        self.current[bset.key] = bset
        named = self._by_group.setdefault((bset.owner_uid, bset.group), {})
        if bset.id not in named:
            named[bset.id] = bset
            self._of_uid.add(bset.owner_uid, bset.id, bset)

    def retire(self, bset: BufferSet) -> None:
        """A new set takes the key; the old one lives until its last holder lets go. See Note [Retired sets]."""
        del self.current[bset.key]
        if bset.holding_slots():
            self.retired[bset.id] = bset
        else:
            self._unindex(bset)

    def remove(self, bset: BufferSet) -> None:
        """Drop a set from every table it is in."""
        if self.current.get(bset.key) is bset:
            del self.current[bset.key]
        self.retired.pop(bset.id, None)
        self._unindex(bset)

    def take_slot(self, bset: BufferSet, slot: Slot) -> None:
        """``slot`` joins ``bset``, an indexed set."""
        if slot.held:
            self.sets_held += not bset.holding_slots()
            self.ranks_held += 1
        bset.slots[slot.rank] = slot
        self._of_pid.add(slot.pid, bset.id, bset)

    def let_go(self, bset: BufferSet, slot: Slot) -> None:
        """``slot``'s rank no longer holds ``bset`` (released, died, failed before its handles went out,
        evicted)."""
        if slot.held:
            slot.held = False
            self.ranks_held -= 1
            self.sets_held -= not bset.holding_slots()

    def sets_of_pid(self, pid: int) -> list[BufferSet]:
        """The indexed sets in which ``pid`` has a slot, held or not."""
        return list(self._of_pid.get(pid, {}).values())

    def _unindex(self, bset: BufferSet) -> None:
        named = self._by_group.get((bset.owner_uid, bset.group), {})
        if named.pop(bset.id, None) is not None:
            self._of_uid.discard(bset.owner_uid, bset.id)
            for slot in bset.slots.values():
                self._of_pid.discard(slot.pid, bset.id)
        if not named:
            self._by_group.pop((bset.owner_uid, bset.group), None)

    def size(self) -> int:
        """How many sets the index keeps, current and retired."""
        return len(self.current) + len(self.retired)

    def size_of(self, uid: int | None) -> int:
        """How many of them are ``uid``'s."""
        return len(self._of_uid.get(uid, {}))

    def of_group(self, uid: int | None, group: str) -> list[BufferSet]:
        """Every set, current or retired, of one group of one uid's namespace."""
        return list(self._by_group.get((uid, group), {}).values())

    def all(self) -> list[BufferSet]:
        # list() copies of dict values: atomic under the GIL, so the metrics thread may call it
        return list(self.current.values()) + list(self.retired.values())

    # ------------------------------------------------------------ what tp_agree asks of the sets

    def pids_holding_rank(self, uid: int | None, group: str, rank: int) -> set[int]:
        """Pids holding ``rank`` in a set of the group, retired ones too (see Note [Retired sets]):
        the only ones who may vote for it in tp_agree."""
        return {
            slot.pid
            for bset in self.of_group(uid, group)
            if (slot := bset.slots.get(rank)) is not None and slot.held and not slot.dead
        }

    def group_sizes(self, uid: int | None, group: str) -> set[int]:
        """The npes of the group's sets some rank holds: the only ones its tp_agree may vote with."""
        return {bset.npes for bset in self.of_group(uid, group) if bset.holding_slots()}

    def ranks_left(self, uid: int | None, group: str) -> dict[int, str]:
        """rank -> why, of the group's ranks that left a set its peers still hold and hold no set of it
        now: absent from an agreement the group starts only after they left."""
        return {
            slot.rank: slot.left
            for bset in self.of_group(uid, group) if bset.holding_slots()
            for slot in bset.slots.values()
            if slot.left is not None and not self.pids_holding_rank(uid, group, slot.rank)
        }

    def ranks_died_holding(self, uid: int | None, group: str) -> dict[int, int]:
        """rank -> pid of the group's ranks that died holding a set: members of its agreement too."""
        return {
            slot.rank: slot.pid for bset in self.of_group(uid, group) for slot in bset.slots.values() if slot.dead
        }

    # ------------------------------------------------------------ counts and listing

    def visible_to(self, uid: int | None, every: bool) -> list[BufferSet]:
        """The sets of ``uid``'s namespace (of every one if ``every``), by id: what its `ls` pages through."""
        shown = self.all() if every else list(self._of_uid.get(uid, {}).values())
        return sorted(shown, key=lambda b: b.id)

    def clear(self) -> None:
        self.current.clear()
        self.retired.clear()
        self._by_group.clear()
        self._of_uid.clear()
        self._of_pid.clear()
        self.ranks_held = self.sets_held = 0


def listing_position(bset: BufferSet) -> tuple:
    """Where a set sorts in `ls`, and what a client's cursor names: group, name, owner uid, and the set's id,
    which tells apart the sets of one key (a retired one still held, and the one joining)."""
    return bset.group, bset.name, -1 if bset.owner_uid is None else bset.owner_uid, bset.id


def listing_entry(b: BufferSet, now: float) -> dict[str, Any]:
    """What `ls` shows of a set."""
    return {
        "group": b.group,
        "uid": b.owner_uid,
        "name": b.name,
        "set": b.id,
        "state": b.state.value,
        "npes": b.npes,
        "joined": sorted(b.slots),
        "held": sorted(s.rank for s in b.holding_slots()),
        "pids": {str(r): s.pid for r, s in sorted(b.slots.items())},
        "nbytes": b.nbytes,
        "bytes_allocated": sum(s.allocation.size for s in b.slots.values() if s.allocation),
        "age_s": round(now - b.created, 3),
        "failure": b.failure.message if b.failure else None,
    }
