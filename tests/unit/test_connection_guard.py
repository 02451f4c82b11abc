"""The connection guard's caps, against its counters alone: no daemon, no connection accepted."""

from __future__ import annotations

import pytest
import zmq

from peerd.connections import ADMIN_CONNECTIONS, ConnectionGuard, ConnectionLimits

ROOT, DAEMON_USER, ALICE, BOB = 0, 990, 1001, 1002
ADMINS = frozenset({ROOT, DAEMON_USER})


@pytest.fixture
def guard():
    """A guard under 6 connections in all, 3 a uid, whose thread never runs: ``take`` admits as it would."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    made = ConnectionGuard(router, ConnectionLimits(total=6, per_uid=3), ADMINS, lambda uid, gid, groups: True)
    yield made
    made._monitor.close(linger=0)
    router.close(linger=0)
    ctx.term()


def take(guard: ConnectionGuard, uid: int) -> str | None:
    """Why a connection of ``uid`` is shut down, or None: then it is held, as _admit holds it."""
    why = guard._over_cap(uid, uid, lambda: ())
    if why is None:
        fd = 1000 + len(guard._uid_of)
        guard._uid_of[fd] = uid
        guard._by_uid[uid] += 1
    return why


def test_other_uids_filling_the_cap_leave_its_last_connections_to_root_and_the_daemons_user(guard):
    """Alice's 3 and Bob's 3 connections took all 6, and root's and the daemon user's `peerd status` were
    shut down: the liveness probe restarted the daemon. Others now stop at 6 less the reserve."""
    reserved = guard.limits.reserved
    assert reserved == 3, "at most half the cap is kept"
    assert [take(guard, ALICE) for _ in range(3)] == [None] * 3
    why = take(guard, BOB)
    assert why is not None and "kept for root and its own user" in why, why
    assert take(guard, ROOT) is None and take(guard, DAEMON_USER) is None
    assert take(guard, ROOT) is None
    assert "(--max-connections)" in take(guard, DAEMON_USER), "the admins stop at the cap itself: the fd budget"
    assert guard.snapshot()["open"] == guard.limits.total


@pytest.mark.parametrize("total, reserved", [(1, 0), (2, 1), (6, 3), (8, ADMIN_CONNECTIONS), (4096, ADMIN_CONNECTIONS)])
def test_the_reserve_is_at_most_half_the_cap(total, reserved):
    """Kept inside --max-connections (the fd budget counts that cap: see the test above), so a small cap
    leaves the others a share."""
    assert ConnectionLimits(total, 1).reserved == reserved
