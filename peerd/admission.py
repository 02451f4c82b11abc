"""Who may call what: the daemon's admission rules as one pure function.

Kept apart from the event loop (as pyzmq's zmq/auth keeps policy apart from its loop) so
the rules read in one place and unit tests check them without sockets or processes.
"""

from __future__ import annotations

from .ops import Op
from .protocol import ErrorCode, ProtocolError
from .credentials import Credentials


def admins_of(daemon_uid: int) -> frozenset[int]:
    """Who may call the admin-only ops of a daemon running as ``daemon_uid``: root and that uid."""
    return frozenset({0, daemon_uid})


def forbidden(who: Credentials) -> ProtocolError:
    """The refusal of a caller outside the allowlist."""
    return ProtocolError(
        ErrorCode.FORBIDDEN,
        f"uid {who.uid} (gid {who.gid}) may not use this peerd; the operator can allow it "
        "with --allow-uid or --allow-gid",
    )


def admit(op: Op, who: Credentials, allowed: bool, draining: bool,
          admins: frozenset[int]) -> ProtocolError | None:
    """None when ``who`` may call ``op`` now (its record says who may), else the refusal to answer with.

    ``allowed`` is the allowlist's verdict on the caller; ``admins`` are root and the daemon's uid.
    """
    if not allowed:
        return forbidden(who)
    if op.admin_only and who.uid not in admins:
        uids = " or ".join(f"uid {uid}" for uid in sorted(admins - {0}) or [0])
        return ProtocolError(ErrorCode.FORBIDDEN, f"only root or {uids} may {op.name}; uid {who.uid} may not")
    if draining and not op.while_draining:
        return ProtocolError(ErrorCode.SHUTTING_DOWN,
                             f"the peerd daemon is shutting down and takes no new {op.name}s")
    return None
