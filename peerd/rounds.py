"""One vote among a group's ranks: tp_agree's rounds and a buffer set's commit vote.

Every rank votes once and the result is the AND, with the no-voters' reasons.
Each rank's call waits for the verdict; a rank that asks after it settled
hears the same verdict at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from .outbox import Caller, Outbox, Send


@dataclass
class Round:
    """One round: every rank votes once, the result is the AND."""

    npes: int
    votes: dict[int, bool] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)
    waiters: dict[int, Caller] = field(default_factory=dict)
    result: tuple[bool, str] | None = None
    on_settle: Callable[[], None] | None = None  # cancels its timeout (and counts it settled)
    deadline: float = math.inf  # when it times out: the earliest of its voters' deadlines

    def vote(self, rank: int, ok: bool, reason: str, caller: Caller | None) -> Outbox:
        """``caller`` None: a vote nobody waits on here (the rank learns the verdict elsewhere). A caller
        already waiting for ``rank`` (another process took the rank meanwhile) hears False, never nothing."""
        out: Outbox = []
        self.votes[rank] = ok
        if not ok:
            self.reasons.append(f"rank {rank}: {reason}" if reason else f"rank {rank} voted no")
        if caller is not None:
            displaced = self.waiters.get(rank)
            if displaced is not None and displaced != caller:
                out.append(Send(displaced, {"ok": False, "reason": f"rank {rank} voted again from another call, "
                                                                   "which counts instead of this one"}))
            self.waiters[rank] = caller
        if len(self.votes) == self.npes:
            out += self.finish(all(self.votes.values()), self.reason)
        return out

    @property
    def reason(self) -> str:
        """Why the round is False so far: every no vote's reason."""
        return "; ".join(self.reasons)

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
