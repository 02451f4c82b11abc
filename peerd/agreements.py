"""tp_agree: the k-th call of each rank of a group is round k, its result the AND.

An agreement is keyed by (owner uid, group), in the caller's own namespace
like a buffer set. Its members are the ranks that voted, plus the ranks of
the group that died holding a buffer set: a death before a rank's first vote
still fails the round it would have voted in, at once instead of by timeout.
While some pid holds a rank in a buffer set of the group, only that pid may
vote for the rank (a forked child cannot vote with its parent's rank).

Failure is reported to every waiting rank, never left to a hang: a death, a
departure or a timeout makes the round False, with a reason naming the ranks
and pids. A rank that released its last set of the group while its peers
still held theirs has left (as on the control page: peerd.pages, Note [A
leaving rank aborts late]): the rounds it is missing are False, as for a
dead rank, until it votes again or joins a set of the group again; then it
enters the round after the last one its peers entered, as a process taking
a dead rank's place does.
Agreements are bounded by the caps in ``peerd.quotas``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from .buffersets import RankKey, SetIndex
from .credentials import Credentials
from .index import Index
from .outbox import Caller, Outbox, Send, rank_out_of_range, refuse
from .protocol import ErrorCode, ProtocolError
from .quotas import Quotas
from .rounds import Round
from .timers import Timers, Waits

log = logging.getLogger("peerd.agreements")


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
    left: dict[int, str] = field(default_factory=dict)  # rank -> why it left the group, until it takes part again
    floor: int = 1  # the oldest round still kept
    beyond: int = 0  # rounds from this one on were False at once: too far ahead (0: none); see ``collect``
    beyond_reason: str = ""

    @property
    def key(self) -> tuple[int | None, str]:
        return (self.owner_uid, self.group)

    def slowest(self) -> tuple[int, int]:
        """(rounds entered, rank) of the slowest live member; one not seen yet has entered none."""
        live = [(self.calls.get(r, 0), r) for r in range(self.npes) if self.present(r)]
        return min(live, default=(max(self.calls.values(), default=0), -1))

    def present(self, rank: int) -> bool:
        """Neither dead nor gone: its peers wait for its vote."""
        return rank not in self.dead and rank not in self.left

    def most_entered(self, besides: int | None = None) -> int:
        """The most rounds a present member (other than ``besides``) has entered: an absent one's count for nothing."""
        return max((c for r, c in self.calls.items() if self.present(r) and r != besides), default=0)

    def collect(self) -> None:
        """Forget rounds every live rank has passed; a dead rank passes them all.

        Rounds are numbered without gaps, so only the oldest few are looked at
        and each is forgotten once: the cost is linear in the rounds played,
        however many a rank pipelines. With no round left every live rank has
        made the same number of calls, so the count starts again from zero:
        nothing grows while a group lives. The members stay known, so a rank
        that dies between rounds still fails the next round at once instead of
        leaving its peers to time out.

        Rounds from ``beyond`` on are kept as that number alone: every one of
        them is False, for whichever rank enters it, until every live rank
        has entered the last one entered; then the count starts again.
        """
        passed, _ = self.slowest()
        while self.floor <= passed and self.floor in self.rounds:
            if self.rounds[self.floor].result is None:
                break
            del self.rounds[self.floor]
            self.floor += 1
        if not self.rounds and (not self.beyond or passed >= self.most_entered()):
            self.calls.clear()
            self.floor, self.beyond, self.beyond_reason = 1, 0, ""

    def finished(self) -> bool:
        """Every member it knew of is dead: nobody can still be waiting on it."""
        return set(self.pids) <= set(self.dead)

    def absences(self, ranks: list[int]) -> str:
        """Why each of these absent ranks will not vote."""
        return "; ".join(f"rank {r} (pid {self.dead[r]}) died" if r in self.dead else self.left[r] for r in ranks)


class Agreements:
    """Every agreement the daemon keeps, and tp_agree's rules."""

    def __init__(self, timers: Timers, quotas: Quotas, sets: SetIndex, waits: Waits):
        self._timers = timers
        self._quotas = quotas
        self._sets = sets  # asked who holds a rank, and which ranks died holding one
        self._waits = waits
        self.kept: dict[tuple[int | None, str], Agreement] = {}  # by (uid, group)
        self.voting: Index[int, tuple[int | None, str], Agreement] = Index()  # pid -> the agreements it votes in
        self.evicted: dict[tuple[int | None, str], set[int]] = {}  # by (uid, group): pids that voted before it
        self.stopping: str | None = None  # why every round is False: the daemon drains

    def agree(self, caller: Caller, who: Credentials, req: dict[str, Any], now: float) -> Outbox:
        pid, uid = who.pid, who.uid
        group, rank, npes = req["group"], req["rank"], req["npes"]
        if invalid := rank_out_of_range(caller, group, rank, npes):
            return [invalid]
        if self.stopping:
            return [Send(caller, {"ok": False, "reason": self.stopping})]
        holders = self._sets.pids_holding_rank(uid, group, rank)
        sizes, expected = self._sets.group_sizes(uid, group), npes
        if sizes and npes not in sizes:  # else a stray vote could fix the group's npes before its members did
            if pid not in holders or len(sizes) > 1:
                return [refuse(caller, ErrorCode.MISMATCH, f"rank {rank} of group={group} agrees with npes={npes} "
                                                           f"but the group's buffer sets have npes={min(sizes)}")]
            expected = min(sizes)  # the rank's holder got its npes wrong: its peers' round fails, below
        if holders and pid not in holders:
            return [refuse(caller, ErrorCode.NOT_MEMBER, f"rank {rank} of group={group} is held by pid "
                           f"{', '.join(map(str, sorted(holders)))} (a buffer set of it), not pid {pid}: "
                           "only the process holding a rank may vote for it")]
        gone = self.evicted.get((uid, group))
        if gone and pid in gone:
            if not holders:  # a vote of the evicted group: it never passes again (this pid may join anew)
                return [Send(caller, {"ok": False, "reason": f"group={group} was evicted by an administrator: "
                                                             "build the PeerBuffer again"})]
            self._forgive(uid, group, pid)
        out, agreement = self._agreement_for(caller, pid, uid, group, rank, expected, pid in holders)
        if agreement is None:
            return out
        group_npes = expected if sizes else agreement.npes  # its buffer sets', else its agreement's
        if npes != group_npes or agreement.npes != npes:
            has = group_npes if npes != group_npes else agreement.npes  # (an agreement older than the sets)
            wrong = f"called tp_agree with npes={npes}, but the group has npes={has}"
            if agreement.npes == group_npes and rank < group_npes and \
                    (agreement.pids.get(rank, pid) == pid or pid in holders):
                # the rank's voter (or its first: a stray of the uid could as well vote with the right npes): its
                # no fails its peers' round at once, where they would wait out the timeout blaming an absent rank
                # (on the control page: peerd_client.agree)
                out += self._enter(None, agreement, rank, pid, holders, False, wrong, req["timeout"], now)
            return out + [refuse(caller, ErrorCode.MISMATCH, f"rank {rank} of group={group} {wrong}")]
        return out + self._enter(caller, agreement, rank, pid, holders, req["ok"], "", req["timeout"], now)

    def _enter(self, caller: Caller | None, agreement: Agreement, rank: int, pid: int, holders: set[int], ok: bool,
               reason: str, timeout: float | None, now: float) -> Outbox:
        """``pid``'s vote for ``rank`` in its next round; ``caller`` None: nobody waits for the verdict here."""
        out: Outbox = []
        group, uid = agreement.group, agreement.owner_uid
        if holders and agreement.pids.get(rank, pid) not in holders:  # another process holds the rank now (the
            self._hand_over(agreement, rank, pid)  # one that voted released it): it goes on from the rank's count
        owner = agreement.pids.setdefault(rank, pid)
        if owner != pid:
            message = f"rank {rank} of group={group} votes from pid {owner}, not {pid}"
            return out + [refuse(caller, ErrorCode.NOT_MEMBER, message)]
        self._votes_in(pid, agreement)
        k = agreement.calls.get(rank, 0) + 1
        rnd = agreement.rounds.get(k)
        if rnd is None:
            ahead = not agreement.beyond and self._quotas.run_ahead(agreement, rank, k)
            if ahead:
                agreement.beyond, agreement.beyond_reason = k, ahead
                log.warning("group=%s agreement rounds from %d on: False (%s)", group, k, ahead)
            if agreement.beyond and k >= agreement.beyond:
                agreement.calls[rank] = k
                if caller is not None:
                    out.append(Send(caller, {"ok": False, "reason": f"agreement round {k} of group={group}: "
                                                                    f"{agreement.beyond_reason}"}))
                return out + self._collect(agreement)  # the last rank to enter the last such round: in step
            refusal = self._quotas.round_refusal(agreement)
            if refusal:
                return out + ([] if caller is None else [refuse(caller, ErrorCode.LIMIT_EXCEEDED, refusal)])
            rnd = agreement.rounds[k] = Round(agreement.npes)
            self._quotas.count_open_round(uid, 1)
            rnd.on_settle = lambda: self._quotas.count_open_round(uid, -1)
        if rnd.result is None:
            self._time_round(agreement, k, rnd, timeout or self._waits.agreement, now)
        agreement.calls[rank] = k
        settled = rnd.result is not None
        if settled:
            out += [] if caller is None else [rnd.answer(caller)]
        else:
            out += rnd.vote(rank, ok, reason, caller)
            absent = [r for r in rnd.missing() if not agreement.present(r)]
            if absent and rnd.result is None:
                out += rnd.finish(False, agreement.absences(absent))
        if not settled and rnd.result is not None and not rnd.result[0]:
            log.warning("group=%s agreement round %d: False (%s)", group, k, rnd.result[1])
        return out + self._collect(agreement)

    def _agreement_for(
        self, caller: Caller, pid: int, uid: int | None, group: str, rank: int, npes: int, holds: bool
    ) -> tuple[Outbox, Agreement | None]:
        """The group's agreement, started if need be; None (and the refusal) when uid keeps too many.
        ``holds``: ``pid`` holds ``rank`` in a buffer set of the group, whose ``npes`` this is."""
        agreement = self.kept.get((uid, group))
        out: Outbox = []
        if agreement is not None and agreement.npes != npes and not agreement.rounds and holds:
            # older than the group's sets (votes of another npes under the same key, whose voters live on),
            # with no round pending: the sets' npes wins, where it refused every call of their ranks
            self._drop(agreement, "")
            agreement = None
        if agreement is not None and (agreement.dead.get(rank, pid) != pid or rank in agreement.left):
            self._returns(agreement, rank, pid)
        if agreement is not None:
            return out, agreement
        refusal = self._quotas.agreements_refusal(uid, group)
        if refusal:
            return out + [refuse(caller, ErrorCode.LIMIT_EXCEEDED, refusal)], None
        agreement = self.kept[(uid, group)] = Agreement(group, npes, uid)
        self._quotas.count_agreement(uid, 1)
        for dead_rank, dead_pid in self._sets.ranks_died_holding(uid, group).items():
            if dead_rank != rank and dead_rank < npes:
                agreement.pids[dead_rank] = agreement.dead[dead_rank] = dead_pid
        for gone_rank, why in self._sets.ranks_left(uid, group).items():  # as rank_left would have, had it been
            if gone_rank != rank and gone_rank < npes and gone_rank not in agreement.dead:  # kept already
                agreement.left[gone_rank] = why
        return out, agreement

    def _returns(self, agreement: Agreement, rank: int, pid: int) -> None:
        """A new process takes a dead rank's place, or a rank that left votes or joins a set again: it
        enters the group's next round, after every round a peer entered (each False already: the rank was
        absent), never one it entered itself; the peers keep their count."""
        own = agreement.calls.get(rank, 0) if rank in agreement.left else 0  # the rounds its last voter entered:
        # that process may still wait in one, and lives (a dead rank's rounds are all False: none is entered again)
        agreement.dead.pop(rank, None)
        agreement.left.pop(rank, None)
        self._hand_over(agreement, rank, pid)
        agreement.calls[rank] = max(own, agreement.most_entered(besides=rank))
        log.info("group=%s rank=%d: pid %d takes part again, from round %d (the rank had died or left)",
                 agreement.group, rank, pid, agreement.calls[rank] + 1)
        agreement.collect()

    def _hand_over(self, agreement: Agreement, rank: int, pid: int) -> None:
        """``pid`` votes for ``rank`` from now on; the process that did, if another, votes here no more."""
        before = agreement.pids.get(rank)
        agreement.pids[rank] = pid
        if before is not None and before != pid and before not in agreement.pids.values():
            self.voting.discard(before, agreement.key)
        self._votes_in(pid, agreement)

    def rank_back(self, uid: int | None, group: str, rank: int, pid: int, opened: bool) -> None:
        """``pid`` joined a set of the group as ``rank`` (``opened``: and every rank of that set did):
        where that rank had left the group's agreement, it takes part again (its peers' rounds wait for
        it) before its first vote; where it died, another process takes its place once the new set
        opened (a join alone may never open: the survivors' rounds stay False until then); where the
        process that voted for it lives on but holds it no more, this one votes from the rank's count on:
        its death is then the rank's, and the old process's exit no longer is."""
        agreement = self.kept.get((uid, group))
        if agreement is None:
            return
        if rank in agreement.left or opened and agreement.dead.get(rank, pid) != pid:
            self._returns(agreement, rank, pid)
        elif opened and agreement.pids.get(rank, pid) not in self._sets.pids_holding_rank(uid, group, rank):
            self._hand_over(agreement, rank, pid)

    def _time_round(self, agreement: Agreement, k: int, rnd: Round, timeout: float, now: float) -> None:
        """A voter waits at most ``timeout``: where that ends before the round's deadline, the round
        ends then for every rank (as on the page, the first deadline wins), so a voter with a shorter
        timeout than the round's first hears False in time, not its client's DaemonUnavailable."""
        if now + timeout >= rnd.deadline:
            return
        rnd.deadline = now + timeout
        timer = self._timers.at(rnd.deadline, lambda t, a=agreement: self._round_due(a, k, timeout))
        settled = rnd.on_settle

        def cancel() -> None:
            self._timers.cancel(timer)
            if settled is not None:
                settled()

        rnd.on_settle = cancel

    def _votes_in(self, pid: int, agreement: Agreement) -> None:
        """Index ``pid`` as a voter of ``agreement``, so its death looks at its own agreements alone."""
        self.voting.add(pid, agreement.key, agreement)

    def _drop(self, agreement: Agreement, reason: str) -> Outbox:
        """Forget the agreement; a round still pending is False with ``reason`` for whoever waits in it (a
        caller whose rank another process votes for now is no member any more, yet waits)."""
        out: Outbox = []
        if self.kept.get(agreement.key) is agreement:
            del self.kept[agreement.key]
            self._quotas.count_agreement(agreement.owner_uid, -1)
            for pid in set(agreement.pids.values()):
                self.voting.discard(pid, agreement.key)
            for rnd in agreement.rounds.values():
                out += rnd.finish(False, reason) if rnd.result is None else []
        return out

    def _round_due(self, agreement: Agreement, k: int, timeout: float) -> Outbox:
        rnd = agreement.rounds.get(k)
        if rnd is None or rnd.result is not None:
            return []
        reason = (
            f"agreement round {k} of group={agreement.group} timed out after {timeout:g}s "
            f"waiting for rank(s) {rnd.missing()}" + (f"; {rnd.reason}" if rnd.reasons else "")
        )
        log.warning("%s", reason)
        return rnd.finish(False, reason) + self._collect(agreement)

    def _collect(self, agreement: Agreement) -> Outbox:
        agreement.collect()
        if agreement.finished():
            return self._drop(agreement, f"every member of group={agreement.group}'s agreement died")
        return []

    def evict(self, group: str, uid: int | None, holders: dict[tuple[int | None, str], set[int]]) -> Outbox:
        """Drop the group's agreements (of ``uid`` only, unless None) where no buffer set of it is held any
        more (an eviction of one set of several leaves the rest in step): their pending rounds are False,
        and so is every later vote of their voters, and of the evicted sets' ``holders`` by (uid, group),
        until each holds a set of the group again or dies."""
        out: Outbox = []
        for key, pids in holders.items():
            if pids:
                self.evicted.setdefault(key, set()).update(pids)
        for agreement in list(self.kept.values()):
            if agreement.group != group or (uid is not None and agreement.owner_uid != uid):
                continue
            if self._sets.group_sizes(agreement.owner_uid, group):  # some set of it is still held
                continue
            out += self._drop(agreement, f"group={group} was evicted by an administrator")
            live = set(agreement.pids.values()) - set(agreement.dead.values())
            if live:
                self.evicted.setdefault(agreement.key, set()).update(live)
        return out

    def _forgive(self, uid: int | None, group: str, pid: int) -> None:
        gone = self.evicted[(uid, group)]
        gone.discard(pid)
        if not gone:
            del self.evicted[(uid, group)]

    def process_died(self, pid: int, held: set[RankKey]) -> Outbox:
        """Every rank ``pid`` voted for, or ``held`` in a buffer set, died: its pending rounds are False."""
        for uid, group in [key for key, pids in self.evicted.items() if pid in pids]:
            self._forgive(uid, group, pid)
        ranks = set(held)
        for key, agreement in self.voting.pop(pid, {}).items():
            ranks |= {(key, r) for r, owner in agreement.pids.items() if owner == pid}
        out: Outbox = []
        for key, rank in ranks:
            agreement = self.kept.get(key)
            if agreement is not None and agreement.pids.get(rank, pid) == pid:
                out += self._rank_died(agreement, rank, pid)
        return out

    def _rank_died(self, agreement: Agreement, rank: int, pid: int) -> Outbox:
        """Every pending round the dead rank has not voted in is False now."""
        agreement.pids[rank] = agreement.dead[rank] = pid
        agreement.left.pop(rank, None)
        out = self._fail_rounds_missing(agreement, rank)
        # a member that exits between rounds is the normal end of a job, not news
        log.log(logging.WARNING if out else logging.DEBUG, "group=%s rank=%d pid=%d died%s", agreement.group,
                rank, pid, " while its peers waited in an agreement" if out else "")
        return out + self._collect(agreement)

    def rank_left(self, uid: int | None, group: str, rank: int, pid: int, reason: str) -> Outbox:
        """``pid`` released its last set of the group as ``rank`` while its peers held theirs: the rounds
        it has not voted in are False, now and until it votes again."""
        agreement = self.kept.get((uid, group))
        if agreement is None or rank >= agreement.npes or agreement.pids.get(rank, pid) != pid \
                or not agreement.present(rank):
            return []
        agreement.left[rank] = reason
        out = self._fail_rounds_missing(agreement, rank)
        if out:
            log.warning("group=%s agreement: %s while its peers waited in a round", group, reason)
        return out + self._collect(agreement)

    @staticmethod
    def _fail_rounds_missing(agreement: Agreement, rank: int) -> Outbox:
        """Every pending round the absent ``rank`` has not voted in is False now, with why."""
        out: Outbox = []
        for rnd in agreement.rounds.values():
            if rnd.result is None and rank not in rnd.votes:
                out += rnd.finish(False, agreement.absences([rank]))
        return out

    def drain(self, reason: str) -> Outbox:
        """The daemon is stopping: every round still open, and every one asked for from now on, is False
        with ``reason``, as on the groups' aborted pages."""
        self.stopping = reason
        out: Outbox = []
        for agreement in self.kept.values():
            for rnd in agreement.rounds.values():
                out += rnd.finish(False, reason) if rnd.result is None else []
        return out

    def shutdown(self, error: ProtocolError) -> Outbox:
        """Fail every vote still waiting with ``error``; keep nothing."""
        out: Outbox = []
        for agreement in self.kept.values():
            for rnd in agreement.rounds.values():
                out += [Send(c, error=error) for c in rnd.waiters.values()]
        self.kept.clear()
        self.voting.clear()
        self.evicted.clear()
        self._quotas.forget_agreements()
        return out
