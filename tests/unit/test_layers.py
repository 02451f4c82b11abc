"""A worker loads only what it needs: the wire, the paths, its backend's mapper; never the daemon."""

from __future__ import annotations

import subprocess
import sys

#: the daemon's rules, loop and settings: nothing a worker process may load
DAEMON_MODULES = {
    "peerd.groups", "peerd.registry", "peerd.rendezvous", "peerd.buffersets", "peerd.agreements",
    "peerd.quotas", "peerd.timers", "peerd.rounds", "peerd.outbox", "peerd.server", "peerd.settings", "peerd.pages",
}


def test_importing_the_client_loads_none_of_the_daemon():
    code = "import peerd_client, sys; print('\\n'.join(sorted(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.split()
    assert "peerd_client" in loaded
    assert sorted(DAEMON_MODULES & set(loaded)) == []
