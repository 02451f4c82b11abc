"""Who may call what: the daemon's admission rules as one pure function.

Kept apart from the event loop (as pyzmq's zmq/auth keeps policy apart from its loop) so
the rules read in one place and unit tests check them without sockets or processes.
"""

from __future__ import annotations

from dataclasses import dataclass

from .protocol import ErrorCode, ProtocolError
from .trust import Credentials


@dataclass(frozen=True)
class Access:
    """An op's admission rules."""

    op: str
    admin_only: bool = False  # root and the daemon's uid only: it reaches every uid's groups
    while_draining: bool = True  # served after SIGTERM, while held buffers are given back


ACCESS: dict[str, Access] = {a.op: a for a in (
    Access("join", while_draining=False),  # a new set would outlive the drain
    Access("commit"),
    Access("release"),
    Access("withdraw"),
    Access("agree"),
    Access("evict", admin_only=True),
    Access("hello"),
    Access("status"),
    Access("ls"),
)}


def forbidden(who: Credentials) -> ProtocolError:
    """The refusal of a caller outside the allowlist."""
    return ProtocolError(
        ErrorCode.FORBIDDEN,
        f"uid {who.uid} (gid {who.gid}) may not use this peerd; the operator can allow it "
        "with --allow-uid or --allow-gid",
    )


def admit(access: Access, who: Credentials, allowed: bool, draining: bool,
          admins: frozenset[int]) -> ProtocolError | None:
    """None when ``who`` may call the op now, else the refusal to answer with.

    ``allowed`` is the allowlist's verdict on the caller; ``admins`` are root and the daemon's uid.
    """
    if not allowed:
        return forbidden(who)
    if access.admin_only and who.uid not in admins:
        uids = " or ".join(f"uid {uid}" for uid in sorted(admins - {0}) or [0])
        return ProtocolError(ErrorCode.FORBIDDEN, f"only root or {uids} may {access.op}; uid {who.uid} may not")
    if draining and not access.while_draining:
        return ProtocolError(ErrorCode.SHUTTING_DOWN,
                             f"the peerd daemon is shutting down and takes no new {access.op}s")
    return None
