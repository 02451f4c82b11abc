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

from .atomics import PageError, atomics
from .controlpage import (
    DAEMON_RANK,
    OFF_ABORT,
    OFF_SLEEPERS,
    OFF_SLOTS,
    OFF_VERDICTS,
    OFF_VOTES,
    OFF_WAKE,
    RING,
    ROUND_BITS,
    SLOT_BYTES,
    WAIT_SLICE_S,
    ControlPage,
    Outcome,
    Verdict,
    decode_verdict,
    slot_offset,
    spin_budget,
)
from .turnlock import TurnLock

_ROUND_MASK = (1 << ROUND_BITS) - 1
#: the most a rank waits for the reason of a round the daemon closed (it writes it within its loop turn)
DAEMON_ABORT_WAIT_S = 1.0
AGREED = Verdict(True)
LAYOUT = (OFF_WAKE, OFF_SLEEPERS, OFF_ABORT, OFF_VERDICTS, RING, OFF_SLOTS, SLOT_BYTES, ROUND_BITS)


def native_voter():
    """The compiled round (peerd/_pagevote.c); PageError where it was not built."""
    try:
        from ._pagevote import Voter
    except ImportError as err:
        raise PageError(f"peerd's compiled voter is not built ({err}): reinstall peerd where a C compiler "
                        "is found (pip install peerd builds it)") from None
    return Voter


class PageVoter:
    """One rank's agreement rounds on ``page``; it counts this rank's calls.
    The round itself runs in C (peerd/_pagevote.c, the rules above); this
    class says why a round was False."""

    def __init__(self, page: ControlPage, rank: int, label: str = "", spin_s: float | None = None,
                 commit_rounds: int = 0):
        """``commit_rounds``: the page's first rounds that are the set's commit vote (COMMIT_ROUND on a
        buffer set's page), so a reason numbers the rounds after them as tp_agree's callers count theirs."""
        if not 0 <= rank < page.npes:
            raise ValueError(f"rank {rank} is out of range for the control page's npes={page.npes}")
        self.page, self.rank, self.label = page, rank, label or "this group"
        spin = spin_budget(page.npes) if spin_s is None else spin_s
        self._round = native_voter()(page.address, page.npes, rank, LAYOUT, spin, WAIT_SLICE_S)
        self._turn = TurnLock()  # one round of this rank at a time (see agree), never left held by a Ctrl-C
        self.closed = False  # its buffer was closed: no round starts on a page that may soon be another set's
        self._slots = [page.word(slot_offset(r)) for r in range(page.npes)]
        self._ballots = [page.word(slot_offset(r) + OFF_VOTES) for r in range(page.npes)]
        self._commit_rounds = commit_rounds

    def close(self) -> None:
        """The buffer is closing: a round under way ends as it would; none starts after this."""
        self.closed = True

    @property
    def rounds(self) -> int:
        return self._round.rounds

    @property
    def spin_s(self) -> float:
        return self._round.spin_s

    @spin_s.setter
    def spin_s(self, seconds: float) -> None:
        self._round.spin_s = seconds

    def agree(self, ok: bool, deadline: float) -> Verdict:
        """Vote ``ok`` in the next round and wait for its verdict, at most
        until monotonic instant ``deadline`` (then the round times out).

        Threads of one rank take turns, as their calls through the daemon do:
        a rank's slot holds two rounds' votes, so a third round entered while
        the first is open would write over its vote (Note [Control page layout]).
        A thread whose deadline passes while another's round runs votes nothing, nor does one whose turn
        comes after the buffer was closed (``close``): once every rank released, the page's slot may hold
        the next set's page, whose round it would vote in."""
        if not self._turn.acquire(blocking=False) and \
                not self._turn.acquire(timeout=max(0.0, deadline - time.monotonic())):  # the clock only if contended
            return Verdict(False, f"tp_agree of {self.label}: another thread of rank {self.rank} held its round "
                                  "until this call's deadline (one rank's rounds run one at a time)")
        try:
            if self.closed:
                return Verdict(False, f"tp_agree of {self.label}: rank {self.rank}'s buffer was closed while this "
                                      "call waited for its turn: it voted nothing")
            word = self._round.agree(ok, deadline)
            k = self._round.rounds
        finally:
            self._turn.release()
        return AGREED if word is True else self._read(k, word)

    def _round_name(self, k: int) -> str:
        """Round k as its callers count it: the commit vote, or the n-th tp_agree call's round n."""
        return "the commit vote" if k <= self._commit_rounds else f"agreement round {k - self._commit_rounds}"

    @staticmethod
    def _behind(word: int, k: int) -> bool:
        """The entry holds a later round than k: k's verdict was settled and its entry reused."""
        ahead = (word >> 24) - (k & _ROUND_MASK)
        return 0 < ahead % (1 << ROUND_BITS) < 1 << (ROUND_BITS - 1)

    def _daemons_abort(self):
        """The abort after a round the daemon closed: it closes the round (deciding whether the set
        failed) and then writes the abort with its reason, so a rank that saw the round closed in between
        waits for that reason a moment (a daemon gone meanwhile: the round's plain word)."""
        deadline = time.monotonic() + DAEMON_ABORT_WAIT_S
        while (aborted := self.page.aborted()) is None and time.monotonic() < deadline:
            time.sleep(0.001)
        return aborted

    def _no_votes(self, k: int) -> list[int]:
        """Ranks whose votes word still holds round k (slot at k or k + 1) and says no."""
        atomics().acquire_fence()  # pairs with each voter's release: the votes word is round k's or later
        bit = 1 << (k % 2)
        return [r for r, s in enumerate(self._slots)
                if s.value - k in (0, 1) and not self._ballots[r].value & bit]

    def _read(self, k: int, word: int) -> Verdict:
        """Round k's Verdict from its entry ``word``, with the reason a False one needs."""
        if self._behind(word, k):
            return Verdict(False, f"{self._round_name(k)} of {self.label} was settled and forgotten: rank "
                                  f"{self.rank} is more than {RING} rounds behind its peers")
        _, outcome, rank = decode_verdict(word)
        if outcome == Outcome.VOTED_NO:
            ranks = self._no_votes(k) or [rank]
            return Verdict(False, f"{self._round_name(k)} of {self.label}: rank(s) {ranks} voted no")
        if outcome == Outcome.ABORTED:
            aborted = self.page.aborted() if rank != DAEMON_RANK else self._daemons_abort()
            return Verdict(False, f"{self._round_name(k)} of {self.label} ended: "
                                  f"{aborted.reason if aborted else 'the group was aborted'}")
        missing = [r for r, s in enumerate(self._slots) if s.value < k]  # still: the ranks to blame
        no = self._no_votes(k)
        voted_no = f"; rank(s) {no} voted no" if no else ""  # whatever came, the round was False for them
        if rank == self.rank:
            return Verdict(False, f"{self._round_name(k)} of {self.label} timed out waiting for rank(s) "
                                  f"{missing}{voted_no}")
        if missing:
            return Verdict(False, f"{self._round_name(k)} of {self.label} timed out waiting for rank(s) {missing} "
                                  f"(rank {rank}'s deadline passed first){voted_no}")
        return Verdict(False, f"{self._round_name(k)} of {self.label} timed out: rank {rank} stopped waiting "
                              f"before every rank voted{voted_no}")
