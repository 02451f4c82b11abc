"""tp_agree on the group control page: one rank's rounds, no message to the daemon.

    voter = PageVoter(page, rank, label="group=tp-0")
    verdict = voter.agree(ok, deadline=time.monotonic() + 60)   # Verdict(ok, reason)

The rules are the daemon path's (peerd.groups.Agreement), kept by the page:
the k-th call of this voter is round k; the answer is the AND of every
rank's vote; a round that timed out, or that the abort word ended, is False
for every rank that reaches it, now or later. How the page makes that hold
across processes is Note [Control page layout] in peerd.controlpage.
"""

from __future__ import annotations

import time

from .controlpage import (
    OFF_ABORT,
    RING,
    ROUND_BITS,
    WAIT_SLICE_S,
    ControlPage,
    Outcome,
    Verdict,
    atomics,
    decode_verdict,
    encode_verdict,
    slot_offset,
    spin_budget,
    verdict_offset,
)

_ROUND_MASK = (1 << ROUND_BITS) - 1
AGREED = Verdict(True)


class PageVoter:
    """One rank's agreement rounds on ``page``; it counts this rank's calls."""

    def __init__(self, page: ControlPage, rank: int, label: str = "", spin_s: float | None = None):
        if not 0 <= rank < page.npes:
            raise ValueError(f"rank {rank} is out of range for the control page's npes={page.npes}")
        self.page, self.rank, self.label = page, rank, label or "this group"
        self.spin_s = spin_budget(page.npes) if spin_s is None else spin_s
        self.rounds = 0
        self._round = page.word(slot_offset(rank))
        self._votes = page.word(slot_offset(rank) + 8)
        self._abort = page.word(OFF_ABORT)
        self._slots = [page.word(slot_offset(r)) for r in range(page.npes)]
        self._ballots = [page.word(slot_offset(r) + 8) for r in range(page.npes)]
        self._entries = [page.word(verdict_offset(k)) for k in range(RING)]

    def agree(self, ok: bool, deadline: float) -> Verdict:
        """Vote ``ok`` in the next round and wait for its verdict, at most
        until monotonic instant ``deadline`` (then the round times out)."""
        k = self.rounds = self.rounds + 1
        a, page = atomics(), self.page
        bit = 1 << (k % 2)
        self._votes.value = (self._votes.value & ~bit) | (bit if ok else 0)
        a.store_seq_cst(self._round, k)  # the vote first, then the round
        entry, slots, abort = self._entries[k % RING], self._slots, self._abort
        if all(s.value >= k for s in slots):  # the last vote of the round: waiters may go
            page.wake()
        if abort.value:  # an aborted group passes no round it had not settled
            return self._settle(k, Outcome.ABORTED, self.rank)

        def ready() -> bool:
            return self._settled(entry.value, k) or all(s.value >= k for s in slots) or bool(abort.value)

        spin_until = None
        while not ready():
            now = time.monotonic()
            if now >= deadline:
                return self._settle(k, Outcome.TIMED_OUT, self.rank)
            if spin_until is None:
                spin_until = now + self.spin_s
            elif now >= spin_until:
                page.sleep(ready, min(deadline - now, WAIT_SLICE_S))
        if all(s.value >= k for s in slots):
            a.acquire_fence()  # pairs with each voter's release: the ballots are round k's
            agreed = all(b.value & bit for b in self._ballots)
            return self._settle(k, Outcome.AGREED if agreed else Outcome.VOTED_NO, self.rank)
        return self._settle(k, Outcome.ABORTED, self.rank)  # or round k was settled: its verdict stands

    # ------------------------------------------------------------ verdicts

    @classmethod
    def _settled(cls, word: int, k: int) -> bool:
        """The entry holds round k's verdict, or a later round's (k's was settled long ago)."""
        return (word >> 24) == k & _ROUND_MASK or cls._behind(word, k)

    @staticmethod
    def _behind(word: int, k: int) -> bool:
        """The entry holds a later round than k: k's verdict was settled and its entry reused."""
        ahead = (word >> 24) - (k & _ROUND_MASK)
        return 0 < ahead % (1 << ROUND_BITS) < 1 << (ROUND_BITS - 1)

    def _no_votes(self, k: int) -> list[int]:
        """Ranks whose votes word still holds round k (slot at k or k + 1) and says no."""
        atomics().acquire_fence()  # pairs with each voter's release: the votes word is round k's or later
        bit = 1 << (k % 2)
        return [r for r, s in enumerate(self._slots)
                if s.value - k in (0, 1) and not self._ballots[r].value & bit]

    def _settle(self, k: int, outcome: Outcome, rank: int) -> Verdict:
        """Propose ``outcome`` for round k; the first proposal wins, for every rank.
        A proposal from the votes is sound whenever it can win: while k's entry is
        empty no rank has passed round k, so no slot is past k + 1 and every
        votes word still holds round k's bit."""
        a = atomics()
        entry = self._entries[k % RING]
        proposal = encode_verdict(k, outcome, rank)
        current = entry.value
        while not self._settled(current, k):
            if a.compare_exchange(entry, current, proposal):
                if outcome in (Outcome.TIMED_OUT, Outcome.ABORTED):
                    self.page.wake()  # waiters of round k learn it from the entry
                break
            current = entry.value
        a.acquire_fence()
        return self._read(k)

    def _read(self, k: int) -> Verdict:
        word = self._entries[k % RING].value
        if (word >> 16) & 0xFF == Outcome.AGREED and (word >> 24) == k & _ROUND_MASK:
            return AGREED
        if self._behind(word, k):
            return Verdict(False, f"agreement round {k} of {self.label} was settled and forgotten: rank "
                                  f"{self.rank} is more than {RING} rounds behind its peers")
        _, outcome, rank = decode_verdict(word)
        if outcome == Outcome.VOTED_NO:
            ranks = self._no_votes(k) or [rank]
            return Verdict(False, f"agreement round {k} of {self.label}: rank(s) {ranks} voted no")
        if outcome == Outcome.ABORTED:
            aborted = self.page.aborted()
            return Verdict(False, f"agreement round {k} of {self.label} ended: "
                                  f"{aborted.reason if aborted else 'the group was aborted'}")
        missing = [r for r, s in enumerate(self._slots) if s.value < k]
        if rank == self.rank:
            return Verdict(False, f"agreement round {k} of {self.label} timed out waiting for rank(s) {missing}")
        return Verdict(False, f"agreement round {k} of {self.label} timed out: rank {rank} stopped waiting "
                              f"before every rank voted")
