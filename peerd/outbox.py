"""The replies a registry op owes: plain records, no sockets.

Every op of the registry takes the time as an argument and returns an outbox
of ``Send``s; the daemon's loop delivers them. So the rules never touch a
socket and the unit tests read the replies straight off the return value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable

from .protocol import ErrorCode, ProtocolError

Caller = Hashable  # opaque to the rules: the server's routing id and request id


@dataclass(frozen=True)
class Send:
    """One reply to deliver: a body, or an error."""

    caller: Caller
    body: dict[str, Any] | None = None
    error: ProtocolError | None = None


Outbox = list[Send]


def refuse(caller: Caller, code: ErrorCode, message: str) -> Send:
    """An error reply to one caller."""
    return Send(caller, error=ProtocolError(code, message))


def rank_out_of_range(caller: Caller, group: str, rank: int, npes: int) -> Send | None:
    """RANK_INVALID for a rank past ``npes``, naming the group and the ranks it has; None for one inside."""
    if rank < npes:
        return None
    return refuse(caller, ErrorCode.RANK_INVALID,
                  f"rank {rank} of group={group} is out of range for npes={npes} (its ranks are 0 to {npes - 1})")
