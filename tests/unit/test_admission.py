"""Admission: the allowlist's verdict, admin-only ops, draining; then where the allowlist's groups come from
(the kernel's record at connect, on real sockets)."""

import os
import socket

import pytest
import zmq

from peerd import access
from peerd.access import Allowlist, connection_groups, peer_groups
from peerd.admission import admit
from peerd.credentials import Credentials
from peerd.ops import OPS
from peerd.protocol import ErrorCode

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


# ------------------------------------------------------------ the allowlist's groups: the kernel's, at connect

GROUP_ALLOWED = Allowlist(frozenset({0}), frozenset({5000}))
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="sets another process's groups")


def never():
    raise AssertionError("the groups were read for a caller its uid or primary gid admits")


@pytest.mark.parametrize("uid, gid", [(0, 1000), (1000, 5000)])
def test_a_caller_its_uid_or_primary_gid_admits_costs_no_look_at_its_groups(uid, gid):
    assert GROUP_ALLOWED.admits(uid, gid, never)


@pytest.mark.parametrize("groups, verdict", [
    (lambda: frozenset({7, 5000}), True), (lambda: frozenset({7}), False), (lambda: frozenset({5000}), True),
    (lambda: None, False),  # groups that cannot be known: refused through them, never guessed
])
def test_a_supplementary_group_admits_only_as_the_kernel_recorded_it(groups, verdict):
    assert GROUP_ALLOWED.admits(1000, 1000, groups) is verdict


def test_no_allowed_gid_reads_no_groups():
    assert not Allowlist(frozenset({0}), frozenset()).admits(1000, 1000, never)


def _connect_with_groups(path: str, groups: list[int]) -> int:
    """A child that connects to ``path`` with these supplementary groups, then waits to be killed."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups(groups)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(path)
            os.setgroups([])  # later changes are not the connection's: the kernel kept the ones at connect
            sock.recv(1)
        finally:
            os._exit(0)
    return pid


@needs_root
@pytest.mark.parametrize("count", [3, 300])  # past 256 gids, past what one Python getsockopt reads
def test_peer_groups_are_the_groups_at_connect(tmp_path, count):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "s"))
    listener.listen(1)
    groups = list(range(70000, 70000 + count))
    child = _connect_with_groups(str(tmp_path / "s"), groups)
    try:
        conn, _ = listener.accept()
        with conn:
            assert peer_groups(conn) == frozenset(groups)
    finally:
        os.kill(child, 9)
        os.waitpid(child, 0)
        listener.close()


def test_without_so_peergroups_the_group_route_is_refused_and_said_once(monkeypatch, caplog):
    monkeypatch.setattr(access, "SO_PEERGROUPS", 4242)  # no such option: what a kernel before 4.13 answers
    monkeypatch.setattr(access, "_unsupported_logged", False)
    a, b = socket.socketpair()
    with a, b:
        assert peer_groups(a) is None and peer_groups(a) is None
        assert GROUP_ALLOWED.admits(1000, 1000, lambda: peer_groups(a)) is False
    said = [r for r in caplog.records if "SO_PEERGROUPS" in r.getMessage()]
    assert len(said) == 1 and "never reads them from /proc" in said[0].getMessage()


def test_a_frames_groups_count_only_when_its_fd_is_still_its_own_connection(tmp_path):
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        router.bind(f"ipc://{tmp_path}/z")
        dealer.connect(f"ipc://{tmp_path}/z")
        dealer.send(b"x")
        assert router.poll(5000)
        _, frame = router.recv_multipart(copy=False)
        me = Credentials(os.geteuid(), os.getegid(), os.getpid())
        assert connection_groups(frame, me) == frozenset(os.getgroups())
        # the fd now carries another caller's connection (or another pid's): unknown, never that one's groups
        assert connection_groups(frame, Credentials(me.uid, me.gid, me.pid + 1)) is None
        assert connection_groups(frame, Credentials(me.uid + 1, me.gid, me.pid)) is None
    finally:
        dealer.close(0)
        router.close(0)
        ctx.term()
