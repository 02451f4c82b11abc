"""The daemon's rules of rendezvous, agreement and release, as a pure state machine.

No sockets, no memory, no clock: every op takes its caller's kernel
``Credentials`` and ``now`` and returns an outbox of ``Send``s, the replies the daemon must deliver (``peerd.outbox``). Memory
is reached only through the ``allocate`` and ``free`` callables given at
construction, so the unit tests drive every rule with fakes.

``Registry`` is a thin facade: it builds the parts and offers the ops the
daemon calls. Each part has one job: ``peerd.rendezvous`` the life of a
buffer set (``peerd.buffersets`` the sets and their index),
``peerd.agreements`` tp_agree, ``peerd.quotas`` every limit, ``peerd.timers``
the deadlines, ``peerd.rounds`` one vote.

Every uid has its own key namespace (see ``peerd.buffersets``). Only the
administrators (root and the daemon's uid) see every namespace, in
``listing`` and ``evict``.
"""

from __future__ import annotations

from typing import Any, Callable

from .agreements import Agreement, Agreements
from .buffersets import BufferSet, listing_entry, listing_position
from .credentials import Credentials
from .outbox import Caller, Outbox
from .pages import NoPages, Pages
from .paging import page
from .protocol import DEFAULT_DEADLINE_S, LS_PAGE_BYTES, MAX_LS_PAGE, ErrorCode, ProtocolError
from .quotas import Limits, Quotas
from .rendezvous import Allocate, Footprint, Free, Handed, Ready, Rendezvous
from .timers import Timers, Waits


class Registry:
    """Every buffer set and agreement the daemon knows, and the rules between them."""

    def __init__(
        self,
        allocate: Allocate,
        free: Free,
        rendezvous_timeout: float = DEFAULT_DEADLINE_S,
        agreement_timeout: float = DEFAULT_DEADLINE_S,
        limits: Limits = Limits(),
        admins: frozenset[int] = frozenset({0}),
        handed: Handed = lambda allocations, pids: None,  # memory that needs no record of who maps it
        pages: NoPages | Pages = NoPages(),
        ready: Ready = lambda allocation: True,  # memory handed out as soon as it is allocated
        footprint: Footprint = lambda nbytes: nbytes,  # the size an allocation of nbytes has
        alive: Callable[[int], bool] = lambda pid: True,  # whether a pid runs: kept verdicts are for live jobs
    ):
        self.admins = admins  # uids that see and evict every uid's groups
        self._timers = Timers()
        self._quotas = Quotas(limits)
        self._waits = Waits(rendezvous_timeout, agreement_timeout)
        self._sets = Rendezvous(allocate, free, handed, self._timers, self._quotas, self._waits, pages, ready,
                                left=lambda *member: self._agreements.rank_left(*member),
                                back=lambda *member: self._agreements.rank_back(*member), footprint=footprint,
                                alive=alive)
        self._agreements = Agreements(self._timers, self._quotas, self._sets.index, self._waits)

    def configure(self, limits: Limits, rendezvous_timeout: float, agreement_timeout: float) -> None:
        """New limits and default timeouts (SIGHUP): for what comes next; running waits keep their deadlines."""
        self._quotas.limits = limits
        self._waits.rendezvous, self._waits.agreement = rendezvous_timeout, agreement_timeout

    # ------------------------------------------------------------ ops

    def join(self, caller: Caller, who: Credentials, req: dict[str, Any], now: float) -> Outbox:
        return self._sets.join(caller, who, req, now)

    def withdraw(self, caller: Caller, who: Credentials, req: dict[str, Any], now: float) -> Outbox:
        return self._sets.withdraw(caller, who, req, now)

    def commit(self, caller: Caller, who: Credentials, req: dict[str, Any], now: float) -> Outbox:
        return self._sets.commit(caller, who, req, now)

    def release(self, caller: Caller, who: Credentials, req: dict[str, Any], now: float) -> Outbox:
        return self._sets.release(caller, who, req, now)

    def agree(self, caller: Caller, who: Credentials, req: dict[str, Any], now: float) -> Outbox:
        return self._agreements.agree(caller, who, req, now)

    def opened_set(self, req: dict[str, Any], who: Credentials) -> BufferSet:
        """The set whose handles went out in which ``who`` holds ``rank``: the fd channel's check."""
        return self._sets.opened_set(req, who)

    def evict(self, group: str, name: str | None, uid: int | None = None) -> tuple[Outbox, list[dict[str, Any]]]:
        """Free a group's buffer sets by force, whoever holds them; fail its waits.

        Every uid's group of that key is evicted, unless ``uid`` narrows it to
        one namespace. The holders' kernels may still touch the memory: an
        operator's last resort for a group stuck behind a process that will
        not let go.
        """
        out, evicted = self._sets.evict(group, name, uid)
        holders: dict[tuple[int | None, str], set[int]] = {}
        for entry in evicted:
            holders.setdefault((entry["uid"], entry["group"]), set()).update(entry["holders"].values())
        return out + self._agreements.evict(group, uid, holders), evicted

    def memory_ready(self, now: float, handles: list[bytes]) -> Outbox:
        """The backend has memory ready that was not, in the chunks of these handles: the sets waiting for
        it open (or fail)."""
        return self._sets.memory_ready(now, handles)

    def process_died(self, pid: int, now: float) -> Outbox:
        """A client process is gone: fail what waits on it, drop what it held."""
        out, ranks = self._sets.process_died(pid, now)
        return out + self._agreements.process_died(pid, ranks)

    def drain(self, reason: str) -> Outbox:
        """The daemon is stopping: fail every rendezvous still waiting, and every agreement round from now on
        (their groups' pages are aborted with ``reason`` too); live sets keep their memory for the grace."""
        return self._sets.drain() + self._agreements.drain(reason)

    def shutdown(self) -> Outbox:
        """Fail every wait, free every buffer: the daemon is going away."""
        error = ProtocolError(ErrorCode.SHUTTING_DOWN, "the peerd daemon is shutting down")
        out = self._sets.shutdown(error) + self._agreements.shutdown(error)
        self._timers.clear()
        return out

    def expire(self, now: float) -> Outbox:
        """Fail every wait whose deadline has passed."""
        return self._timers.expire(now)

    def next_deadline(self) -> float | None:
        """When expire() next has work."""
        return self._timers.next_deadline()

    # ------------------------------------------------------------ inspection (status, health, metrics, ls)

    def listing(self, now: float, uid: int | None, after: list | None = None, limit: int = MAX_LS_PAGE,
                max_bytes: int = LS_PAGE_BYTES) -> tuple[list[dict[str, Any]], bool]:
        """One page of what `peerd ls` shows ``uid``, after the cursor ``after`` (peerd.paging): an entry per
        buffer set of its namespace (of every namespace for an administrator), sorted by group, name and uid;
        whether more follow."""
        shown = self._sets.index.visible_to(uid, every=uid in self.admins)
        return page(shown, listing_position, lambda b: listing_entry(b, now), after, limit, max_bytes)

    def all_sets(self) -> list[BufferSet]:
        return self._sets.index.all()

    def set_count(self) -> int:
        """Buffer sets kept, current and retired (failed ones kept as verdicts too)."""
        return self._sets.index.size()

    def sets_held(self) -> int:
        """Buffer sets some rank still holds."""
        return self._sets.index.sets_held

    def ranks_holding(self) -> int:
        """Ranks holding a buffer set, over every set."""
        return self._sets.index.ranks_held

    def sets_counted_toward_max_groups(self) -> int:
        """Buffer sets that count against --max-groups: all but failed ones nobody holds."""
        return self._sets.sets_counted()

    @property
    def limits(self) -> Limits:
        return self._quotas.limits

    @property
    def rendezvous_timeout(self) -> float:
        return self._waits.rendezvous

    @property
    def agreement_timeout(self) -> float:
        return self._waits.agreement

    @property
    def rank_deaths(self) -> int:
        """Processes that died holding a rank of a buffer set."""
        return self._sets.rank_deaths

    @property
    def bytes_by_uid(self) -> dict[int | None, int]:
        return self._quotas.bytes_by_uid

    @property
    def bytes_by_device(self) -> dict[str, int]:
        return self._quotas.bytes_by_device

    @property
    def sets(self) -> dict[tuple[int | None, str, str], BufferSet]:
        """The current set of each (uid, group, name)."""
        return self._sets.index.current

    @property
    def retired(self) -> dict[int, BufferSet]:
        """Superseded sets still held by some rank. See Note [Retired sets]."""
        return self._sets.index.retired

    @property
    def agreements(self) -> dict[tuple[int | None, str], Agreement]:
        """The agreements kept, by (uid, group)."""
        return self._agreements.kept

    @property
    def agreements_by_uid(self) -> dict[int | None, int]:
        return self._quotas.agreements_by_uid

    @property
    def open_rounds_by_uid(self) -> dict[int | None, int]:
        return self._quotas.open_rounds_by_uid
