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

import ctypes
import time

from .controlpage import (
    OFF_ABORT,
    RING,
    ROUND_BITS,
    SPIN_S,
    WAIT_SLICE_S,
    ControlPage,
    Outcome,
    Verdict,
    atomics,
    decode_verdict,
    encode_verdict,
    slot_offset,
    verdict_offset,
)

_ROUND_MASK = (1 << ROUND_BITS) - 1
_ACQUIRE, _RELEASE, _SEQ_CST = 2, 3, 5


class PageVoter:
    """One rank's agreement rounds on ``page``; it counts this rank's calls."""

    def __init__(self, page: ControlPage, rank: int, label: str = "", spin_s: float = SPIN_S):
        if not 0 <= rank < page.npes:
            raise ValueError(f"rank {rank} is out of range for the control page's npes={page.npes}")
        self.page, self.rank, self.label, self.spin_s = page, rank, label or "this group", spin_s
        self.rounds = 0
        self._round_address = page.address + slot_offset(rank)
        self._votes = page.word(slot_offset(rank) + 8)
        self._abort = page.word(OFF_ABORT)
        self._slots = [page.word(slot_offset(r)) for r in range(page.npes)]

    def agree(self, ok: bool, deadline: float) -> Verdict:
        """Vote ``ok`` in the next round and wait for its verdict, at most
        until monotonic instant ``deadline`` (then the round times out)."""
        k = self.rounds = self.rounds + 1
        entry = self.page.word(verdict_offset(k))
        bit = 1 << (k % 2)
        self._votes.value = (self._votes.value & ~bit) | (bit if ok else 0)
        atomics().store(self._round_address, k, _RELEASE)  # the vote first, then the round
        self.page.wake()
        if self._abort.value:  # an aborted group passes no round it had not settled
            return self._settle(k, Outcome.ABORTED, self.rank)

        def settled() -> bool:
            return (entry.value >> 24) == k & _ROUND_MASK or self._behind(entry.value, k)

        def arrived() -> bool:
            return all(s.value >= k for s in self._slots)

        def ready() -> bool:
            return settled() or arrived() or bool(self._abort.value)

        spin_until = time.monotonic() + self.spin_s
        while not ready():
            now = time.monotonic()
            if now >= deadline:
                return self._settle(k, Outcome.TIMED_OUT, self.rank)
            if now >= spin_until:
                self.page.sleep(ready, min(deadline - now, WAIT_SLICE_S))
        if settled():
            return self._read(k)
        if arrived():
            return self._settle(k, *self._tally(k))
        return self._settle(k, Outcome.ABORTED, self.rank)

    # ------------------------------------------------------------ verdicts

    @staticmethod
    def _behind(word: int, k: int) -> bool:
        """The entry holds a later round than k: k's verdict was settled and its entry reused."""
        ahead = (word >> 24) - (k & _ROUND_MASK)
        return 0 < ahead % (1 << ROUND_BITS) < 1 << (ROUND_BITS - 1)

    def _tally(self, k: int) -> tuple[Outcome, int]:
        """Every slot reached k: the AND of round k's votes, and the first rank that voted no."""
        no = self._no_votes(k)
        return (Outcome.VOTED_NO, no[0]) if no else (Outcome.AGREED, self.rank)

    def _no_votes(self, k: int) -> list[int]:
        """Ranks whose votes word still holds round k (slot at k or k + 1) and says no."""
        atomics().fence(_ACQUIRE)  # pairs with each voter's release: the votes word is round k's or later
        bit = 1 << (k % 2)
        return [r for r, s in enumerate(self._slots)
                if s.value - k in (0, 1) and not self.page.word(slot_offset(r) + 8).value & bit]

    def _settle(self, k: int, outcome: Outcome, rank: int) -> Verdict:
        """Propose ``outcome`` for round k; the first proposal wins, for every rank."""
        a = atomics()
        address = self.page.address + verdict_offset(k)
        proposal = encode_verdict(k, outcome, rank)
        while True:
            current = a.load(address, _ACQUIRE)
            if (current >> 24) == k & _ROUND_MASK or self._behind(current, k):
                break
            if a.cas(address, ctypes.byref(ctypes.c_uint64(current)), proposal, _SEQ_CST, _SEQ_CST):
                if outcome in (Outcome.TIMED_OUT, Outcome.ABORTED):
                    self.page.wake()  # waiters of round k learn it from the entry
                break
        return self._read(k)

    def _read(self, k: int) -> Verdict:
        word = self.page.word(verdict_offset(k)).value
        if self._behind(word, k):
            return Verdict(False, f"agreement round {k} of {self.label} was settled and forgotten: rank "
                                  f"{self.rank} is more than {RING} rounds behind its peers")
        _, outcome, rank = decode_verdict(word)
        if outcome == Outcome.AGREED:
            return Verdict(True)
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
