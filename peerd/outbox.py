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
