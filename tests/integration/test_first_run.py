"""What a newcomer meets first: help texts, stop messages, stable error codes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.conftest import Daemon, run_ranks, start_rank, wait_until


def test_run_help_does_not_offer_the_socket_it_refuses():
    result = subprocess.run([sys.executable, "-m", "peerd", "run", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "--socket-group" in result.stdout
    assert "--socket " not in result.stdout and "--socket TEXT" not in result.stdout


def test_daemon_unavailable_carries_a_stable_code(socket_dir):
    d = Daemon(os.path.join(socket_dir, "absent.sock"), Path(socket_dir) / "unused.log")
    (result,) = run_ranks(d, "agree", 1, "--group", "g")
    assert result["type"] == "DaemonUnavailable" and result["code"] == "DAEMON_UNAVAILABLE", result


def test_a_drain_says_how_to_stop_at_once_and_names_who_still_held_memory(socket_dir):
    d = Daemon(os.path.join(socket_dir, "peerd.sock"), Path(socket_dir) / "daemon.log",
               args=("--shutdown-grace", "1")).start()
    holder = start_rank(d, "join", 0, 1, "--group", "kept", "--hold", "60")
    try:
        wait_until(lambda: "group=kept name=default live" in d.logs(), 90, "the set to go live")
        d.proc.send_signal(signal.SIGINT)
        assert d.proc.wait(timeout=30) == 0, d.logs()
        logs = d.logs()
        assert "a second Ctrl-C" in logs, logs
        assert f"WARNING peerd.server: group=kept name=default is still held by rank 0 (pid {holder.pid})" in logs
    finally:
        holder.kill()
        holder.wait()
