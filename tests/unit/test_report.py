"""What `peerd status` shows whom: a user sees its own connections and arenas, administrators everyone's."""

import json

from peerd import report
from peerd.registry import Registry
from tests.unit.test_groups import FakeMemory

LOOP = {"draining": False, "reload_failed": None, "restart_pending": [], "metrics_unserved": None,
        "connections": {"open": 5, "max": 64, "max_per_uid": 8, "refused": 0, "top_uids": [[1001, 3], [1000, 2]]}}


class OneDevice:
    name = "fake"

    def devices(self) -> list:
        return [{"uuid": "gpu0", "arenas": [{"uid": 1000, "chunks": 1, "reserved_bytes": 64, "handed_out_bytes": 8},
                                            {"uid": 1001, "chunks": 2, "reserved_bytes": 128, "handed_out_bytes": 0}]}]


def status_for(viewer: int, **loop) -> dict:
    mem = FakeMemory()
    registry = Registry(mem.allocate, mem.free, admins=frozenset({0, 990}))
    return report.status(registry, OneDevice(), 1, viewer, {**LOOP, **loop}, [])


def test_a_failed_reload_degrades_the_status_and_only_administrators_read_the_file_s_words():
    """Where no systemd shows STATUS= (Kubernetes), a failed reload was in the log alone."""
    failed = "the last reload failed, the running configuration is kept: /etc/peerd/peerd.toml: bad key"
    assert status_for(0, reload_failed=failed)["problems"] == [failed]
    user = status_for(1000, reload_failed=failed)
    assert user["health"] == "degraded" and user["problems"] == [
        "the last reload of the configuration failed (the daemon's log says why)"]
    assert "peerd.toml" not in json.dumps(user), "the file's words reach administrators alone, --json included"
    assert status_for(0, restart_pending=["backend"])["health"] == "healthy", "a pending restart is no problem"


def test_a_user_sees_only_its_own_connection_count():
    assert status_for(1000)["connections"]["top_uids"] == [[1000, 2]]
    assert status_for(4242)["connections"]["top_uids"] == []


def test_administrators_see_every_uids_connections():
    for admin in (0, 990):
        assert status_for(admin)["connections"]["top_uids"] == [[1001, 3], [1000, 2]]


def test_a_user_sees_only_its_own_arena_chunks():
    (device,) = status_for(1000)["devices"]
    assert [a["uid"] for a in device["arenas"]] == [1000]
    (device,) = status_for(0)["devices"]
    assert [a["uid"] for a in device["arenas"]] == [1000, 1001]
