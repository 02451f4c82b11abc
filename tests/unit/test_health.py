"""What `peerd status` calls a problem, and who may read whose group names in it."""

from __future__ import annotations

from peerd.health import problems
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
        (problem,) = problems(reg, [], 100.0, viewer)
        assert "group=secret-job" in problem and "past its timeouts" in problem, (viewer, problem)
    (hidden,) = problems(reg, [], 100.0, OTHER)
    assert hidden.startswith("a buffer set of another user has been joining") and "secret-job" not in hidden


def test_nothing_is_a_problem_within_the_timeouts():
    assert problems(stuck_registry(), [], 5.0, OTHER) == []
