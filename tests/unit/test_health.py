"""What `peerd status` calls a problem, and who may read whose group names in it."""

from __future__ import annotations

from peerd.health import SCAN_EVERY_S, StuckSets, problems
from peerd.registry import Registry
from tests.unit.test_groups import FakeMemory, who

OWNER, OTHER = 1000, 2000


def stuck_registry() -> Registry:
    """One rank of uid OWNER joined group "secret-job" and waits long past the timeouts."""
    mem = FakeMemory()
    reg = Registry(mem.allocate, mem.free, rendezvous_timeout=10, agreement_timeout=10,
                   admins=frozenset({0}))
    body = {"group": "secret-job", "name": "n", "rank": 0, "npes": 2, "nbytes": 64, "device": "d",
            "flags": 0, "timeout": 1000}
    assert reg.join(("c", 0), who(4242, OWNER), body, 0.0) == []
    return reg


def test_a_stuck_set_degrades_the_daemon_for_every_caller_but_names_it_only_to_its_owner_and_admins():
    reg = stuck_registry()
    for viewer in (None, 0, OWNER):
        (problem,) = problems(reg, [], StuckSets().scan(reg, 100.0), viewer)
        assert "group=secret-job" in problem and "past its timeouts" in problem, (viewer, problem)
    (hidden,) = problems(reg, [], StuckSets().scan(reg, 100.0), OTHER)
    assert hidden.startswith("a buffer set of another user has been joining") and "secret-job" not in hidden


def test_nothing_is_a_problem_within_the_timeouts():
    reg = stuck_registry()
    assert problems(reg, [], StuckSets().scan(reg, 5.0), OTHER) == []


def test_status_requests_in_a_loop_walk_the_sets_once_a_second():
    """A user asking for status in a loop must not buy a walk over every user's sets each time: within
    SCAN_EVERY_S the last walk answers, and the walk after it sees what changed."""
    reg, stuck = stuck_registry(), StuckSets()
    walks = []
    all_sets = reg.all_sets
    reg.all_sets = lambda: walks.append(1) or all_sets()
    assert len(stuck.scan(reg, 100.0)) == 1
    reg.process_died(4242, 100.1)  # the stuck set fails; nobody holds it
    assert len(stuck.scan(reg, 100.0 + SCAN_EVERY_S / 2)) == 1 and len(walks) == 1, "the last walk answers"
    assert stuck.scan(reg, 100.0 + SCAN_EVERY_S) == [] and len(walks) == 2, "a second later, a new walk"
