"""Property-based tests: no input crashes the decoder; no sequence of events
leaks memory, double-frees, answers a request twice or leaves one unanswered."""

from __future__ import annotations

import itertools

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from peerd import ops, protocol
from peerd.buffersets import State
from peerd.credentials import Credentials
from peerd.registry import Registry
from peerd.protocol import ProtocolError
from tests.unit.test_groups import FakeMemory

values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=20,
)


@given(st.binary(max_size=512))
def test_any_bytes_decode_or_raise_protocol_error(frame):
    try:
        ops.decode_request(frame)
    except ProtocolError:
        pass


@given(st.sampled_from(sorted(ops.OPS) + ["nope"]), values, st.integers(-5, 2**64 - 1) | values)
def test_any_msgpack_request_decodes_or_raises_protocol_error(op, body, request_id):
    frame = msgpack.packb({"v": protocol.VERSION, "id": request_id, "op": op, "body": body}, use_bin_type=True)
    try:
        request = ops.decode_request(frame)
    except ProtocolError:
        return
    assert request.op == op and set(request.body) == set(ops.OPS[op].request)


PIDS = [100, 101, 102, 103, 104]
# Mostly a rank's own process (pid 100 + rank) acting as the rules expect, so sets open, go live and are
# released; now and then another process, a join that disagrees on the set's shape, a no vote.
actor = st.sampled_from(["own"] * 6 + PIDS)
event = st.one_of(
    st.tuples(st.just("join"), st.integers(0, 2), st.sampled_from([False] * 6 + [True]), actor),
    st.tuples(st.just("join"), st.integers(0, 2), st.just(False), actor),
    st.tuples(st.just("commit"), st.integers(0, 2), st.sampled_from([True] * 4 + [False]), actor),
    st.tuples(st.just("release"), st.integers(0, 2), actor),
    st.tuples(st.just("agree"), st.integers(0, 2), st.sampled_from([True] * 4 + [False]), actor),
    st.tuples(st.just("die"), st.sampled_from(PIDS)),
    st.tuples(st.just("wait"), st.sampled_from([0.5, 3.0, 30.0])),
    st.tuples(st.just("evict")),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(event, min_size=4, max_size=60), st.sampled_from(["n1", "n2"]), st.sampled_from([2, 3]))
def test_no_sequence_of_events_leaks_double_frees_or_hangs(events, name, npes):
    mem = FakeMemory()
    reg = Registry(mem.allocate, mem.free, rendezvous_timeout=10, agreement_timeout=10)
    ids = itertools.count()
    issued: dict[tuple, int] = {}  # caller -> pid
    answered: set = set()
    dead: set[int] = set()
    now = 0.0

    def deliver(out):
        for send in out:
            assert send.caller not in answered, f"answered twice: {send.caller}"
            answered.add(send.caller)

    def call(method, pid, body):
        caller = ("c", next(ids))
        issued[caller] = pid
        deliver(method(caller, Credentials(None, None, pid), body, now))

    def check():
        """What must hold after every event."""
        held = {s.allocation.handle for b in reg.all_sets() for s in b.slots.values() if s.allocation}
        assert held == set(mem.live), "every live allocation belongs to exactly one slot"
        counted = sum(b.state is not State.FAILED or bool(b.holding_slots()) for b in reg.all_sets())
        assert reg.sets_counted_toward_max_groups() == counted == reg._sets.sets_of_uid_counted(None), \
            "the sets counted as they come and go are those the limits mean: all but failed ones nobody holds"
        assert reg.ranks_holding() == sum(len(b.holding_slots()) for b in reg.all_sets()), \
            "the ranks held, as kept while slots are taken and let go, are those a walk finds"
        assert reg.sets_held() == sum(1 for b in reg.all_sets() if b.holding_slots()), "and so are the sets held"
        verdicts = {i for kept in reg._sets._verdicts.values() for i in kept}
        assert verdicts == {b.id for b in reg.all_sets() if b.state is State.FAILED and not b.holding_slots()}, \
            "a failed set nobody holds is kept as a verdict, and only such a set"
        by_pid: dict[int, set[int]] = {}
        for b in reg.all_sets():
            for slot in b.slots.values():
                by_pid.setdefault(slot.pid, set()).add(b.id)
        assert {pid: {b.id for b in reg._sets.index.sets_of_pid(pid)} for pid in by_pid} == by_pid, \
            "a death looks at the sets its pid has a slot in: all of them"
        assert all(not reg._sets.index.sets_of_pid(pid) for pid in set(PIDS) - set(by_pid)), "and no stale one"
        voters: dict[int, dict] = {}
        for key, agreement in reg.agreements.items():
            for rank, pid in agreement.pids.items():
                if rank not in agreement.dead:
                    voters.setdefault(pid, {})[key] = agreement
        assert reg._agreements.voting == voters, \
            "a death looks at the agreements its pid votes in: all of them, and none it left or that was dropped"

    for ev in events:
        kind = ev[0]
        if kind == "wait":
            now += ev[1]
            deliver(reg.expire(now))
            check()
            continue
        if kind == "evict":
            out, _ = reg.evict("g", None)
            deliver(out)
            check()
            continue
        if kind == "die":
            if ev[1] not in dead:
                dead.add(ev[1])
                deliver(reg.process_died(ev[1], now))
            check()
            continue
        pid = 100 + ev[1] if ev[-1] == "own" else ev[-1]
        if pid in dead:
            continue  # the dead send nothing
        if kind == "join":
            call(reg.join, pid, {"group": "g", "name": name, "rank": ev[1], "npes": npes + ev[2], "nbytes": 64,
                                 "device": "d", "flags": 0, "timeout": None})
        elif kind == "commit":
            call(reg.commit, pid, {"group": "g", "name": name, "rank": ev[1], "ok": ev[2], "reason": "",
                                   "timeout": None, "page": False})
        elif kind == "release":
            call(reg.release, pid, {"group": "g", "name": name, "rank": ev[1]})
        else:
            call(reg.agree, pid, {"group": "g", "rank": ev[1], "npes": 3, "ok": ev[2], "timeout": None})
        check()

    now += 1000
    deliver(reg.expire(now))
    unanswered = [c for c, pid in issued.items() if c not in answered and pid not in dead]
    assert not unanswered, f"requests of live processes never answered: {unanswered}"
    for pid in PIDS:
        if pid not in dead:
            deliver(reg.process_died(pid, now))
    deliver(reg.expire(now + 1000))
    assert mem.live == {}, "memory left once every process is gone"
    assert reg.sets == {} and reg.retired == {} and reg.agreements == {}
