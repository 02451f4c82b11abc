"""tp_agree through the daemon: no process group, and a dead rank means False, fast."""

from __future__ import annotations

import logging

from .connection import GRACE_S, connection
from .groupkey import resolve

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
    wait = (timeout or conn.hello["agreement_timeout"]) + GRACE_S
    member = resolve(group, rank, npes, wait)
    verdict = conn.call(
        "agree",
        {"group": member.key, "rank": member.rank, "npes": member.npes, "ok": bool(ok), "timeout": timeout},
        timeout=wait,
    )
    if not verdict["ok"] and verdict["reason"]:
        log.warning("tp_agree on group=%s is False: %s", member.key, verdict["reason"])
    return verdict["ok"]
