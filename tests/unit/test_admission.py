"""Admission without sockets: the allowlist's verdict, admin-only ops, draining."""

import pytest

from peerd.admission import admit
from peerd.ops import OPS
from peerd.protocol import ErrorCode
from peerd.credentials import Credentials

ADMINS = frozenset({0, 990})
USER = Credentials(1000, 1000, 4242)


@pytest.mark.parametrize("op", sorted(OPS))
def test_an_allowed_caller_may_call_every_op_but_evict(op):
    refusal = admit(OPS[op], USER, True, False, ADMINS)
    assert (refusal is None) == (op != "evict")


@pytest.mark.parametrize("op", sorted(OPS))
def test_a_caller_outside_the_allowlist_is_refused_every_op_with_the_way_out(op):
    refusal = admit(OPS[op], USER, False, False, ADMINS)
    assert refusal.code is ErrorCode.FORBIDDEN and "--allow-uid or --allow-gid" in refusal.message


@pytest.mark.parametrize("uid", sorted(ADMINS))
def test_root_and_the_daemons_uid_may_evict(uid):
    assert admit(OPS["evict"], Credentials(uid, uid, 1), True, False, ADMINS) is None


def test_evict_by_another_uid_names_who_may():
    refusal = admit(OPS["evict"], USER, True, False, ADMINS)
    assert refusal.code is ErrorCode.FORBIDDEN
    assert refusal.message == "only root or uid 990 may evict; uid 1000 may not"
    as_root = admit(OPS["evict"], USER, True, False, frozenset({0}))
    assert as_root.message == "only root or uid 0 may evict; uid 1000 may not"


@pytest.mark.parametrize("op", sorted(OPS))
def test_a_draining_daemon_takes_no_joins_and_serves_the_rest(op):
    refusal = admit(OPS[op], Credentials(0, 0, 1), True, True, ADMINS)
    if op == "join":
        assert refusal.code is ErrorCode.SHUTTING_DOWN and "takes no new joins" in refusal.message
    else:
        assert refusal is None


def test_every_op_record_resolves_to_its_handler():
    """The daemon builds its dispatch from the records: a registry op needs Registry.<name>, any other op
    Daemon._serve_<name>, and nothing is served that no record declares."""
    from peerd.registry import Registry
    from peerd.server import Daemon

    for op in OPS.values():
        owner, attribute = (Registry, op.name) if op.registry else (Daemon, f"_serve_{op.name}")
        assert callable(getattr(owner, attribute, None)), (op.name, owner.__name__, attribute)
    served = {name[len("_serve_"):] for name in dir(Daemon) if name.startswith("_serve_")}
    assert served == {op.name for op in OPS.values() if not op.registry}
