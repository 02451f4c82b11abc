"""`peerd selftest` as a newcomer runs it: with a daemon, without one, without torch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def selftest(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "peerd", "selftest", *args], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=180)


def test_selftest_passes_against_the_running_daemon(daemon):
    result = selftest(daemon.env(), "--ranks", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS: 2 rank(s)" in result.stdout and "private daemon" not in result.stdout
    assert "joined (2/2)" in daemon.logs(), "the ranks used the running daemon"


def test_with_no_daemon_it_runs_on_a_private_one_and_says_so(socket_dir):
    result = selftest({"PEERD_SOCKET": os.path.join(socket_dir, "none.sock")}, "--ranks", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no daemon socket at" in result.stdout and "testing on a private daemon" in result.stdout
    assert "PASS: 2 rank(s)" in result.stdout


def test_without_torch_it_says_so_once_in_one_line(socket_dir, tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None  # torch not installed\n")
    env = {"PEERD_SOCKET": os.path.join(socket_dir, "none.sock"),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    result = selftest(env, "--ranks", "8")
    assert result.returncode == 1
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert len(lines) == 1 and "need torch" in lines[0] and "pip install" in lines[0], lines
    assert len(lines[0]) < 300


def test_the_same_failure_on_every_rank_is_said_once(daemon):
    result = selftest(daemon.env(), "--ranks", "4", "--device", "meta")
    assert result.returncode == 1
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("FAIL: every rank:"), result.stdout


def test_a_socket_whose_daemon_is_down_fails_with_the_reason_not_a_private_pass(socket_dir):
    """A node check: with the node's daemon down (its socket left behind), it passed on a private daemon."""
    import socket

    path = os.path.join(socket_dir, "peerd.sock")
    with socket.socket(socket.AF_UNIX) as stale:  # bound, never listening: a crashed daemon's socket
        stale.bind(path)
        result = selftest({"PEERD_SOCKET": path}, "--ranks", "2")
    assert result.returncode == 1 and "private daemon" not in result.stdout + result.stderr
    assert f"FAIL: the daemon at {path} cannot be used" in result.stderr, result.stderr


def test_a_relative_socket_path_reaches_the_daemon_it_names(daemon):
    """The workers start in /: a relative path (PEERD_SOCKET or --socket) is the caller's, made absolute."""
    here = os.path.dirname(daemon.socket)
    result = subprocess.run([sys.executable, "-m", "peerd", "selftest", "--ranks", "2", "--socket",
                             os.path.basename(daemon.socket)], cwd=here, env=daemon.env(), capture_output=True,
                            text=True, timeout=180)
    assert result.returncode == 0 and "private daemon" not in result.stdout, result.stdout + result.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user (CI runs as root)")
def test_a_socket_in_a_directory_the_user_may_not_enter_is_no_reason_for_a_private_pass(socket_dir):
    """/run/peerd is 0750: a user outside its group could not see the socket, so the check passed on a
    private daemon while the node's was not this user's to use."""
    from peerd.paths import something_at

    closed = os.path.join(socket_dir, "run")
    os.mkdir(closed, 0o700)
    os.chmod(socket_dir, 0o755)
    path = os.path.join(closed, "peerd.sock")
    pid = os.fork()
    if pid == 0:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
        os._exit(0 if something_at(path) and not something_at(os.path.join(socket_dir, "none.sock")) else 1)
    assert os.waitpid(pid, 0)[1] == 0
