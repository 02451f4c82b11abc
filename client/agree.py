"""tp_agree through the daemon: no process group, and a dead rank means False, fast."""

from __future__ import annotations

import logging
import os
import time

from peerd.pageagree import PageVoter
from peerd.protocol import ErrorCode

from .connection import GRACE_S, checked_timeout, connection
from .errors import DaemonUnavailable, ForkedProcessError, MonoUnsupported
from .groupkey import Contradicted, joined_by, resolve
from .pagelink import GroupLink, link_for

log = logging.getLogger("peerd_client")

#: How long a tp_agree refused for a wrong npes, an unusable timeout or a rank= that contradicts its place
#: waits for its peers to reach its round, so they read its no; then it times the round out (its peers hear
#: False all the same) and raises. On the daemon's message path a wrong npes is refused at once and its no
#: stays in the round.
REFUSED_CALL_WAIT_S = 1.0


def tp_agree(ok: bool, group, rank: int | None = None, npes: int | None = None, timeout: float | None = None) -> bool:
    """True when every rank of ``group`` passed ``ok`` true. Every rank must call
    it at the same point: the k-th call of each rank forms round k. ``group`` is
    a string key (with rank and npes, unless this process joined a PeerBuffer of
    it), a torch ProcessGroup, or None for a single rank. A rank that dies or
    does not come within the timeout makes the round False for everyone; the
    reason is logged.

    Where every rank of the group mapped its live set's control page, the
    round runs there without a message to the daemon; else through the
    daemon. A set from an earlier daemon run (it restarted) makes every
    round False. A call refused for its arguments is still this rank's call
    at that point: it votes no in its round (its peers hear False at once,
    and the next round finds every rank in step), then raises."""
    if group is None:
        return bool(ok)
    try:
        checked_timeout("tp_agree", timeout)  # on both paths: the page's wait would have no deadline
    except MonoUnsupported:
        _no_in_its_round(group, rank, npes)
        raise
    try:
        return _agree(bool(ok), group, rank, npes, timeout)
    except Contradicted:  # rank=/npes= against the place this process holds, which names its round itself
        _no_in_its_round(group, None, None)
        raise


def _no_in_its_round(group, rank: int | None, npes: int | None) -> None:
    """The no of a call refused for its arguments, in the round it is."""
    try:
        _agree(False, group, rank, npes, REFUSED_CALL_WAIT_S)
    except Contradicted:  # the round is that of the place this process holds
        _no_in_its_round(group, None, None)
    except (MonoUnsupported, ForkedProcessError, ValueError, TypeError) as err:
        log.warning("tp_agree on %s could not vote this rank's no: %s", group, err)


def _agree(ok: bool, group, rank: int | None, npes: int | None, timeout: float | None) -> bool:
    link = link_for(group) if isinstance(group, str) else None
    voter = link.voter if link is not None else None  # once: another thread's close() may clear it
    if voter is not None and not link.daemon_gone and \
            (rank, npes) in ((None, None), (link.rank, link.npes)):  # a decode step's guard: nothing to resolve
        return _round_on_page(voter, group, ok, timeout or link.agreement_timeout)
    conn = connection()
    timeout = timeout or conn.hello["agreement_timeout"]  # decided here and sent: the daemon waits as long
    try:
        member = resolve(group, rank, npes, timeout)
    except MonoUnsupported as err:  # a process group's rank 0 never came: as a rank absent from the round
        if err.code != ErrorCode.TIMEOUT.value:
            raise
        log.warning("tp_agree is False: %s", err)
        return False
    joiner = joined_by(member.key)
    if joiner is not None and joiner != os.getpid():
        raise ForkedProcessError(
            f"group={member.key} was joined by pid {joiner}; pid {os.getpid()} is a forked child and holds "
            "none of its ranks: only the process holding a rank may vote for it (agree in a group of its own)"
        )
    link = link_for(member.key)
    if link is not None:
        verdict = _on_link(link, member, ok, timeout, conn.hello.get("instance"))
        if verdict is not None:
            return verdict
    verdict = conn.call(
        "agree",
        {"group": member.key, "rank": member.rank, "npes": member.npes, "ok": ok, "timeout": timeout},
        timeout=timeout + GRACE_S,
    )
    if not verdict["ok"] and verdict["reason"]:
        log.warning("tp_agree on group=%s is False: %s", member.key, verdict["reason"])
    return verdict["ok"]


def _on_link(link: GroupLink, member, ok: bool, timeout: float, instance: int | None) -> bool | None:
    """The round on the group's control page, False for a set of an earlier daemon run;
    None where the group has no page (the daemon decides)."""
    if member.rank != link.rank or (member.npes != link.npes and (link.instance != instance or link.daemon_gone)):
        raise MonoUnsupported(f"tp_agree on group={member.key} as rank {member.rank} of {member.npes}, but this "
                              f"process holds rank {link.rank} of {link.npes} in it", "MISMATCH")
    if member.npes != link.npes:  # this rank's no ends the round its peers wait in, at once, not at its timeout
        voter = link.voter
        if voter is None:
            return None  # the daemon refuses it, and votes that no (peerd.agreements)
        _round_on_page(voter, member.key, False, min(timeout, REFUSED_CALL_WAIT_S))
        raise MonoUnsupported(f"tp_agree on group={member.key} as rank {member.rank} of {member.npes}, but the "
                              f"group has npes={link.npes}: this rank voted no in the round", "MISMATCH")
    if link.instance != instance:
        log.warning("tp_agree on group=%s is False: its buffers came from daemon instance %s, the daemon now "
                    "is instance %s (it restarted): build the PeerBuffer again", member.key,
                    f"{link.instance:#x}" if link.instance else "unknown", f"{instance:#x}" if instance else "unknown")
        return False
    voter = link.voter
    if voter is None:
        return None
    if link.daemon_gone:
        raise DaemonUnavailable(f"the peerd daemon (instance {link.instance:#x}) that made group={member.key}'s "
                                "control page went away: build the PeerBuffer again once a daemon runs")
    return _round_on_page(voter, member.key, ok, timeout)


def _round_on_page(voter: PageVoter, key: str, ok: bool, timeout: float) -> bool:
    """The next round on a link's page (its voter, read once: another thread's close() may clear the
    link's); a False verdict's reason is logged."""
    verdict = voter.agree(ok, time.monotonic() + timeout)
    if not verdict.ok:
        log.warning("tp_agree on group=%s is False: %s", key, verdict.reason)
    return verdict.ok
