"""What `peerd status` shows whom: a user sees its own connections, administrators everyone's."""

from peerd import report
from peerd.registry import Registry
from tests.unit.test_groups import FakeMemory

LOOP = {"draining": False, "connections": {"open": 5, "max": 64, "max_per_uid": 8, "refused": 0,
                                           "top_uids": [[1001, 3], [1000, 2]]}}


class NoDevices:
    name = "fake"

    def devices(self) -> list:
        return []


def status_for(viewer: int) -> dict:
    mem = FakeMemory()
    registry = Registry(mem.allocate, mem.free, admins=frozenset({0, 990}))
    return report.status(registry, NoDevices(), 1, viewer, LOOP)


def test_a_user_sees_only_its_own_connection_count():
    assert status_for(1000)["connections"]["top_uids"] == [[1000, 2]]
    assert status_for(4242)["connections"]["top_uids"] == []


def test_administrators_see_every_uids_connections():
    for admin in (0, 990):
        assert status_for(admin)["connections"]["top_uids"] == [[1001, 3], [1000, 2]]
