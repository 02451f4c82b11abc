"""The total connection cap, filled by other uids, still leaves root and the daemon's user their `peerd status`.

Real extra users (CI runs as root) and a real daemon running as a user of its own, as the shipped
unit and the Kubernetes DaemonSet run it: one tenant may supply many uids, and the liveness probe
(`peerd status; test $? -ne 3`) restarts the daemon when status cannot connect, failing every group.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from peerd.connections import ConnectionLimits
from tests.conftest import Daemon, local_users, wait_until
from tests.integration.test_flood import flood, procs, status_as  # noqa: F401 (procs: the fixture)

DAEMON_USER, ALICE, BOB, SOCKET_GROUP = "pdk-daemon", "pdk-alice", "pdk-bob", "pdk-sock"
TESTS = Path(__file__).parents[1]
LIMITS = ConnectionLimits(total=6, per_uid=3)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create users (CI runs as root)")


@pytest.fixture(scope="module")
def users():
    """name -> "uid:gid:socket gid", for the daemon's user and two others; all in the socket group."""
    with local_users(SOCKET_GROUP, DAEMON_USER, ALICE, BOB) as specs:
        yield specs


@pytest.fixture
def daemon(procs, socket_dir, users):
    """A daemon running as DAEMON_USER under LIMITS; every client trusts that user."""
    uid, gid, _ = map(int, users[DAEMON_USER].split(":"))
    os.chown(socket_dir, uid, gid)
    os.chmod(socket_dir, 0o755)
    d = Daemon(os.path.join(socket_dir, "run", "peerd.sock"), Path(socket_dir) / "daemon.log",
               extra_env={"PEERD_DAEMON_USER": DAEMON_USER})
    d.proc = subprocess.Popen(
        [sys.executable, str(TESTS / "as_user.py"), users[DAEMON_USER], "serve", "--backend", "host",
         "--socket", d.socket, "--socket-group", SOCKET_GROUP, "--max-connections", str(LIMITS.total),
         "--max-connections-per-uid", str(LIMITS.per_uid)],
        stdout=open(d.log, "ab"), stderr=subprocess.STDOUT, env=d.env())
    procs.append(d.proc)
    wait_until(lambda: "serving" in d.logs() or d.proc.poll() is not None, 60, "the daemon to start")
    assert d.proc.poll() is None, d.logs()
    yield d
    assert d.stop() == 0, d.logs()[-3000:]


def fill(procs, d: Daemon, users: dict) -> None:
    """Alice and Bob each open as many idle connections as their per-uid cap allows: together, the total cap."""
    for user in (ALICE, BOB):
        flood(procs, d, "idle", users[user], LIMITS.per_uid)


def test_root_and_the_daemons_user_get_status_when_other_uids_fill_the_total_cap(procs, daemon, users):
    """Alice's 3 and Bob's 3 connections took all 6 of --max-connections, and `peerd status` from root and
    from the daemon's own user exited 3, as if the daemon were dead: the probe restarted it."""
    fill(procs, daemon, users)
    statuses = {"root": daemon.cli("status", "--json"), DAEMON_USER: status_as(daemon, users[DAEMON_USER])}
    for who, status in statuses.items():
        assert status.returncode in (0, 1), f"`peerd status` as {who}: {status.returncode} {status.stderr}"
    held = dict(map(tuple, json.loads(statuses["root"].stdout)["connections"]["top_uids"]))
    others = sum(held.get(int(users[user].split(":")[0]), 0) for user in (ALICE, BOB))
    assert others <= LIMITS.total - LIMITS.reserved, held
    assert "kept for root and its own user" in daemon.logs()
