"""tp_agree through the daemon: no process group, and a dead rank means False, fast."""

from __future__ import annotations

import logging
import os

from .connection import GRACE_S, connection
from .errors import ForkedProcessError
from .groupkey import joined_by, resolve

log = logging.getLogger("peerd_client")


def tp_agree(ok: bool, group, rank: int | None = None, npes: int | None = None, timeout: float | None = None) -> bool:
    """True when every rank of ``group`` passed ``ok`` true. Every rank must call
    it at the same point: the k-th call of each rank forms round k. ``group`` is
    a string key (with rank and npes, unless this process joined a PeerBuffer of
    it), a torch ProcessGroup, or None for a single rank. A rank that dies or
    does not come within the timeout makes the round False for everyone; the
    reason is logged."""
    if group is None:
        return bool(ok)
    conn = connection()
    timeout = timeout or conn.hello["agreement_timeout"]  # decided here and sent: the daemon waits as long
    member = resolve(group, rank, npes, timeout + GRACE_S)
    joiner = joined_by(member.key)
    if joiner is not None and joiner != os.getpid():
        raise ForkedProcessError(
            f"group={member.key} was joined by pid {joiner}; pid {os.getpid()} is a forked child and holds "
            "none of its ranks: only the process holding a rank may vote for it (agree in a group of its own)"
        )
    verdict = conn.call(
        "agree",
        {"group": member.key, "rank": member.rank, "npes": member.npes, "ok": bool(ok), "timeout": timeout},
        timeout=timeout + GRACE_S,
    )
    if not verdict["ok"] and verdict["reason"]:
        log.warning("tp_agree on group=%s is False: %s", member.key, verdict["reason"])
    return verdict["ok"]
