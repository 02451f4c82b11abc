"""Every limit on what callers may take, and the tallies it is checked against.

One owner for every limit: the shape of a request (ranks, buffer size), the
bytes each uid and each device hold, the buffer sets the daemon keeps, and
the agreements' caps. Every check runs before anything is allocated or
opened, and says which limit, by which flag, refused the caller.

Agreements are bounded: a round more than ``MAX_RUN_AHEAD`` rounds ahead of
the slowest live member is False at once and not kept (peerd.agreements), and one
uid may keep at most ``MAX_AGREEMENTS_PER_UID`` agreements and
``MAX_PENDING_ROUNDS_PER_UID`` unsettled rounds, so pipelined votes cost
linear time and bounded memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .index import tally
from .sizes import human

if TYPE_CHECKING:
    from .agreements import Agreement

#: How many rounds a rank may be ahead of the slowest live member of its agreement
#: before its rounds are False at once: one that waits for each verdict is that far
#: ahead only of a member that stopped or is slow to vote, whose rounds time out.
MAX_RUN_AHEAD = 8

#: Agreements one uid may keep at once (kept while any member lives).
MAX_AGREEMENTS_PER_UID = 1024

#: Agreement rounds one uid may keep unsettled at once, over all its agreements.
MAX_PENDING_ROUNDS_PER_UID = 1024


@dataclass(frozen=True)
class Limits:
    """What one caller may take; None is no limit. Checked before any allocation."""

    max_buffer_bytes: int | None = 16 << 30
    max_bytes_per_uid: int | None = None
    max_bytes_per_device: int | None = None
    max_groups: int | None = 4096
    max_ranks: int | None = 1024
    max_groups_per_uid: int | None = 1024  # a share of max_groups: no one user can take every set


class Quotas:
    """The limits in force (SIGHUP may replace them) and what each uid and device holds now."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.bytes_by_uid: dict[int | None, int] = {}
        self.bytes_by_device: dict[str, int] = {}
        self.agreements_by_uid: dict[int | None, int] = {}
        self.open_rounds_by_uid: dict[int | None, int] = {}  # agreement rounds not settled yet

    # ------------------------------------------------------------ buffer sets

    def shape_refusal(self, req: dict[str, Any]) -> str | None:
        """A join too big whoever asks: more ranks or a bigger buffer than allowed."""
        lim = self.limits
        if lim.max_ranks is not None and req["npes"] > lim.max_ranks:
            return f"npes={req['npes']} exceeds the daemon's limit of {lim.max_ranks} ranks per group (--max-ranks)"
        if lim.max_buffer_bytes is not None and req["nbytes"] > lim.max_buffer_bytes:
            return (f"nbytes={req['nbytes']} ({human(req['nbytes'])}) exceeds the daemon's limit of "
                    f"{lim.max_buffer_bytes} bytes ({human(lim.max_buffer_bytes)}) per buffer (--max-buffer-bytes)")
        return None

    def sets_refusal(self, kept: int, kept_by_uid: int, uid: int | None, group: str, name: str) -> str | None:
        """Why a new buffer set of ``group``/``name`` may not be kept beside ``kept`` others, ``kept_by_uid``
        of them ``uid``'s."""
        limit, share = self.limits.max_groups, self.limits.max_groups_per_uid
        if share is not None and kept_by_uid >= share:
            return (f"uid {uid} already holds {kept_by_uid} buffer sets (--max-groups-per-uid {share}); a new "
                    f"group={group} name={name} is refused: try again once one of its sets is freed")
        if limit is not None and kept >= limit:
            return (f"the daemon already holds {limit} buffer sets (--max-groups {limit}); "
                    f"a new group={group} name={name} is refused: try again once one is freed")
        return None

    def usage_refusal(self, nbytes: int, uid: int | None, device: str) -> str | None:
        """A buffer that would take one uid or one device past its share."""
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

    def charge(self, uid: int | None, device: str, size: int) -> None:
        """``size`` bytes allocated for ``uid`` on ``device`` (negative: freed)."""
        tally(self.bytes_by_uid, uid, size)
        tally(self.bytes_by_device, device, size)

    # ------------------------------------------------------------ agreements

    def agreements_refusal(self, uid: int | None, group: str) -> str | None:
        """Why ``uid`` may not keep one more agreement."""
        kept = self.agreements_by_uid.get(uid, 0)
        if kept >= MAX_AGREEMENTS_PER_UID:
            return (f"uid {uid} already keeps {kept} agreements (at most {MAX_AGREEMENTS_PER_UID}); "
                    f"group={group} is refused: try again once the processes of another one exit")
        return None

    @staticmethod
    def run_ahead(agreement: Agreement, rank: int, k: int) -> str | None:
        """Why round ``k``, which ``rank`` would open, is False without being kept: it is too far ahead of
        the slowest live member (stopped, or slow to vote), so its rounds would pile up in the daemon."""
        behind, slowest = agreement.slowest()
        if k - behind > MAX_RUN_AHEAD:
            return (f"rank {rank} of group={agreement.group} reached round {k} while rank {slowest} "
                    f"(pid {agreement.pids.get(slowest, 'not seen yet')}) has entered {behind}: a rank may run at "
                    f"most {MAX_RUN_AHEAD} rounds ahead, and every round past that is False until the slowest "
                    "catches up")
        return None

    def round_refusal(self, agreement: Agreement) -> str | None:
        """Why a round of ``agreement`` may not open: its uid keeps too many rounds open."""
        open_rounds = self.open_rounds_by_uid.get(agreement.owner_uid, 0)
        if open_rounds >= MAX_PENDING_ROUNDS_PER_UID:
            return (f"uid {agreement.owner_uid} already keeps {open_rounds} agreement rounds unsettled "
                    f"(at most {MAX_PENDING_ROUNDS_PER_UID}); wait for them to settle")
        return None

    def count_agreement(self, uid: int | None, delta: int) -> None:
        tally(self.agreements_by_uid, uid, delta)

    def count_open_round(self, uid: int | None, delta: int) -> None:
        tally(self.open_rounds_by_uid, uid, delta)

    def forget_agreements(self) -> None:
        """Every agreement is gone (shutdown): nothing kept, nothing open."""
        self.agreements_by_uid.clear()
        self.open_rounds_by_uid.clear()
