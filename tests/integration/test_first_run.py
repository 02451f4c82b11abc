"""What a newcomer meets first: help texts, stop messages, stable error codes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import Daemon, finish, run_ranks, shadowed, start_rank, wait_until


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


def test_a_rank_whose_backend_is_missing_fails_with_a_code_and_its_peers_learn_at_once(daemon):
    """Asking for a CUDA buffer where CUDA is unusable: a MonoUnsupported, and no peer waits out its timeout."""
    waiting = start_rank(daemon, "join", 1, 3, "--group", "nocuda", "--timeout", "600", "--linger",
                         stdin=subprocess.PIPE)  # it lives on after the failure, as a worker that falls back does
    wait_until(lambda: "group=nocuda name=default rank=1" in daemon.logs(), 90, "rank 1 to join")
    (missing,) = run_ranks(daemon, "join", 3, "--group", "nocuda", "--device", "cuda:0", ranks=[0])
    assert missing["type"] == "MonoUnsupported" and missing["code"] == "BACKEND_UNAVAILABLE", missing
    assert ("torch sees no GPU here" in missing["message"]  # CPU-only torch; else the daemon's backend is named
            or "the daemon serves host memory" in missing["message"]), missing
    peer = json.loads(waiting.stdout.readline())
    assert peer["code"] == "GROUP_FAILED" and "rank 0" in peer["message"] and "cannot take part" in peer["message"]
    (late,) = run_ranks(daemon, "join", 3, "--group", "nocuda", ranks=[2])  # a peer still to come learns it too
    assert late["code"] == "GROUP_FAILED" and "cannot take part" in late["message"], late
    waiting.communicate("go\n", timeout=60)


def test_a_device_torch_does_not_know_is_a_programming_error_not_a_missing_backend(daemon):
    """device='gpu' (a typo): a ValueError naming it, which an engine does not take for "no GPU here" and
    fall back on silently; its peer learns at once."""
    waiting = start_rank(daemon, "join", 1, 2, "--group", "typo", "--timeout", "600")
    wait_until(lambda: "group=typo name=default rank=1" in daemon.logs(), 90, "rank 1 to join")
    (typo,) = run_ranks(daemon, "join", 2, "--group", "typo", "--device", "gpu", ranks=[0])
    assert typo["type"] == "ValueError" and "device='gpu' is no torch device" in typo["message"], typo
    peer = finish(waiting)
    assert peer["code"] == "GROUP_FAILED" and "device='gpu'" in peer["message"], peer


@pytest.mark.parametrize("wrong", [("--flags", "8"), ("--nbytes", str(1 << 64))], ids=["flags", "nbytes"])
def test_a_field_the_protocol_refuses_is_told_to_the_peers_at_once(daemon, wrong):
    """An unknown flag bit, or a size past any the protocol carries: BAD_REQUEST on that rank, found before
    its join, so its withdrawal fails the peer waiting (which waited out its rendezvous, told it never joined)."""
    waiting = start_rank(daemon, "join", 1, 2, "--group", "refused-field", "--timeout", "600")
    wait_until(lambda: "group=refused-field name=default rank=1" in daemon.logs(), 90, "rank 1 to join")
    (refused,) = run_ranks(daemon, "join", 2, "--group", "refused-field", *wrong, ranks=[0])
    assert refused["code"] == "BAD_REQUEST" and wrong[0][2:] in refused["message"], refused
    peer = finish(waiting, timeout=60)
    assert peer["code"] == "GROUP_FAILED" and "cannot take part" in peer["message"], peer


def test_a_size_past_the_limit_names_the_daemons_limit_in_human_units(daemon):
    (result,) = run_ranks(daemon, "join", 1, "--group", "huge", "--nbytes", str(1 << 50))
    assert result["code"] == "LIMIT_EXCEEDED", result
    assert ("nbytes=1125899906842624 (1.0 PiB) exceeds the daemon's limit of 17179869184 bytes (16.0 GiB) "
            "per buffer (--max-buffer-bytes)") in result["message"], result


def test_a_failed_set_is_listed_as_failed_holding_nothing_with_its_reason_on_a_line_of_its_own(daemon):
    first = start_rank(daemon, "join", 0, 3, "--group", "odd", "--nbytes", "4096")
    wait_until(lambda: "group=odd name=default rank=0" in daemon.logs(), 90, "rank 0 to join")
    (second,) = run_ranks(daemon, "join", 3, "--group", "odd", "--nbytes", "8192", ranks=[1])
    assert second["code"] == "MISMATCH" and finish(first)["code"] == "MISMATCH"
    lines = daemon.cli("ls").stdout.splitlines()
    header, row, why = lines
    assert header.split() == ["GROUP", "NAME", "UID", "RANKS", "SIZE", "HELD", "STATE", "HOLDERS", "AGE"]
    assert " 4.0 KiB  0 B " in row and " failed " in row and row.split()[-2] == "-", row  # SIZE, HELD, no holders
    assert why.startswith("    why failed: rank 1 of group=odd name=default asked for"), why
    assert "0 B allocated" in daemon.cli("status").stdout


def test_a_socket_location_the_daemon_cannot_use_is_named_with_what_to_do(socket_dir):
    """These gave a bare errno ('[Errno 21] Is a directory: ...'), took the working directory for an empty
    path, or served ./5 for `socket = 5` in the file."""
    config = Path(socket_dir) / "peerd.toml"
    config.write_text("socket = 5\n")
    os.mkdir(Path(socket_dir) / "p.sock.lock")
    os.mkfifo(Path(socket_dir) / "fifo")
    cases = [
        (["--socket", os.path.join(socket_dir, "fifo", "p.sock")], f"socket directory {socket_dir}/fifo is a fifo, "
                                                                   "not a directory: give the real path"),
        (["--config", str(config)], "socket takes a string (in quotes), not 5"),
        (["--socket", ""], "the socket path must be a file path, not ''"),
        (["--socket", os.path.join(socket_dir, "p.sock")], f"cannot open the lock file {socket_dir}/p.sock.lock: "
                                                         "Is a directory: give another --socket"),
        (["--socket", "/proc/peerd-test/p.sock"], "cannot create the socket directory /proc/peerd-test: "),
    ]
    for args, says in cases:
        done = subprocess.run([sys.executable, "-m", "peerd", "serve", "--backend", "host", *args], cwd=socket_dir,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 1 and says in done.stderr and "[Errno" not in done.stderr, (args, done.stderr)
    assert sorted(os.listdir(socket_dir)) == ["fifo", "p.sock.lock", "peerd.toml"], "nothing served, nothing made"


def test_a_daemon_that_cannot_have_its_socket_is_refused_before_its_backend_starts(daemon, socket_dir):
    """The cuda backend starts a context on every GPU first (about 1 s and 260 MiB each), and where CUDA is
    missing its error hid the one that mattered: a daemon already serving that socket, or an unsafe directory."""
    open_to_all = Path(socket_dir) / "open"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    cases = [
        (daemon.socket, f"another peerd (pid {daemon.proc.pid}) already serves this socket"),
        (str(open_to_all / "p.sock"), f"socket directory {open_to_all} (mode 0777) is writable by other users"),
    ]
    for path, says in cases:
        done = subprocess.run([sys.executable, "-m", "peerd", "serve", "--backend", "cuda", "--socket", path],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 1 and says in done.stderr and "cuda" not in done.stderr, (path, done.stderr)
    assert daemon.cli("status").returncode == 0


def test_a_single_rank_takes_group_none_as_in_the_seeds(daemon):
    """TP=1: the seeds take group None for a single rank; peerd raised TypeError, which no engine's
    `except MonoUnsupported` fallback catches."""
    (result,) = run_ranks(daemon, "single", 1, "--nbytes", "4096")
    assert result["npes"] == [1, 1] and result["zero"] and result["apart"] and result["agreed"], result
    assert len(set(result["keys"])) == 2 and all(k.startswith("single-") for k in result["keys"]), result


def test_a_rank_given_a_size_no_buffer_can_have_tells_its_peers_at_once(daemon):
    """nbytes=0 on one rank raised ValueError there alone: its peers waited out the whole rendezvous and
    were told that rank "never joined"."""
    waiting = start_rank(daemon, "join", 0, 2, "--group", "zero", "--timeout", "600")
    wait_until(lambda: "group=zero name=default rank=0" in daemon.logs(), 90, "rank 0 to join")
    (bad,) = run_ranks(daemon, "join", 2, "--group", "zero", "--nbytes", "0", ranks=[1])
    assert bad["type"] == "ValueError" and "nbytes must be a positive int, got 0" in bad["message"], bad
    peer = finish(waiting, 60)
    assert peer["code"] == "GROUP_FAILED" and "rank 1" in peer["message"], peer
    assert "cannot take part: ValueError: nbytes must be a positive int, got 0" in peer["message"], peer
    script = ("import torch\nfrom peerd_client import PeerBuffer\n"
              "try:\n    PeerBuffer(0, 'zero', 1, 2, torch.device('cpu'))\nexcept Exception as err:\n"
              "    print(type(err).__name__, err)\n")
    env = {**os.environ, "PEERD_SOCKET": os.path.join(os.path.dirname(daemon.socket), "absent.sock")}
    alone = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert alone.stdout == "ValueError nbytes must be a positive int, got 0\n", "not a DaemonUnavailable, which " \
        f"an engine's fallback would swallow, where no daemon runs: {alone.stdout} {alone.stderr}"


@pytest.mark.parametrize("rank, wrong, code, told", [
    (1, ("--timeout=-1",), "BAD_REQUEST", "rank 1 (pid {pid}) of group=refused name=default cannot take "
                                                      "part: MonoUnsupported: PeerBuffer: field 'timeout' must be"),
    (2, (), "RANK_INVALID", "pid {pid} asked to join group=refused name=default as rank 2 of npes=2"),
], ids=["timeout", "rank"])
def test_a_rank_refused_at_its_join_tells_its_peers_at_once(daemon, rank, wrong, code, told):
    """A rank past npes, or with a timeout no wait can honour, was refused alone: its peers waited out the
    rendezvous (600 s here) and were told it "never joined"."""
    waiting = start_rank(daemon, "join", 0, 2, "--group", "refused", "--timeout", "600")
    wait_until(lambda: "group=refused name=default rank=0" in daemon.logs(), 90, "rank 0 to join")
    bad = start_rank(daemon, "join", rank, 2, "--group", "refused", *wrong)
    refused = finish(bad, 60)
    assert refused["code"] == code, refused
    peer = finish(waiting, 60)
    assert peer["code"] == "GROUP_FAILED" and told.format(pid=bad.pid) in peer["message"], peer


@pytest.mark.parametrize("call, socket", [
    ("PeerBuffer(4096, 'no-rank', timeout=-1)", "daemon"),
    ("PeerBuffer(0, 'g', 0, 2, torch.device('cpu'), timeout=-1)", "absent"),
], ids=["string-key-alone", "no-daemon"])
def test_a_timeout_no_wait_can_honour_is_a_bad_request_before_any_other_error(daemon, call, socket):
    """BAD_REQUEST names the timeout first, as before anything else is asked (the README's contract): told to the
    peers where it can be, it must not turn into the ValueError of a later step."""
    script = (f"import torch\nfrom peerd_client import PeerBuffer, MonoUnsupported\ntry:\n    {call}\n"
              "except MonoUnsupported as err:\n    print(err.code)\n")
    path = daemon.socket if socket == "daemon" else os.path.join(os.path.dirname(daemon.socket), "absent.sock")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PEERD_SOCKET": path})
    assert done.stdout == "BAD_REQUEST\n", (done.stdout, done.stderr)


def test_a_socket_path_no_daemon_can_serve_is_a_daemon_unavailable_naming_peerd_socket(daemon):
    """An engine falls back on MonoUnsupported: a PEERD_SOCKET libzmq cannot use raised a ValueError that
    named neither the variable nor what to do, and took the worker down."""
    script = ("from peerd_client import MonoUnsupported, tp_agree\n"
              "try:\n    tp_agree(True, 'g', 0, 1)\nexcept MonoUnsupported as err:\n    print(err.code, err)\n")
    env = {**os.environ, "PEERD_SOCKET": "@abstract"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert done.stdout.startswith("DAEMON_UNAVAILABLE PEERD_SOCKET names no usable socket: '@abstract' is an "
                                  "abstract-namespace socket"), (done.stdout, done.stderr)


def test_an_evict_nobody_confirmed_says_how_to_without_asking_and_a_bad_count_says_not_an_integer(daemon):
    """Without a terminal (a script, ssh without -t) evict printed its question, then a bare "Aborted!";
    a count that is no number was "not a valid integer range"."""
    holder = start_rank(daemon, "join", 0, 1, "--group", "asked", "--hold", "60")
    try:
        wait_until(lambda: "group=asked name=default live" in daemon.logs(), 90, "the set to go live")
        unasked = subprocess.run([sys.executable, "-m", "peerd", "evict", "asked", "--socket", daemon.socket],
                                 stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
        assert unasked.returncode == 1 and "nothing evicted: not confirmed (pass --yes to evict without asking)" \
            in unasked.stderr, unasked.stderr
        assert "asked  default" in daemon.cli("ls").stdout, "still there"
    finally:
        holder.kill()
        holder.wait()
    bad = subprocess.run([sys.executable, "-m", "peerd", "config"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PEERD_MAX_GROUPS": "abc"})
    assert bad.returncode == 1 and "bad value for max_groups: 'abc' is not an integer" in bad.stderr, bad.stderr


def _shadow(root: Path, package: str, source: str) -> dict:
    return {**os.environ, "PYTHONPATH": shadowed(root, package, source)}


def test_metrics_without_prometheus_client_are_refused_before_anything_and_a_failed_bind_leaves_no_socket(
        socket_dir, tmp_path):
    """A daemon that failed in its bind left its socket, fd channel and lock behind, and every client
    waited 5 s on a socket nobody served instead of hearing at once that no daemon runs."""
    served = Path(socket_dir) / "served"
    command = [sys.executable, "-m", "peerd", "serve", "--backend", "host", "--socket", str(served / "peerd.sock"),
               "--metrics-port", "9"]
    missing = _shadow(tmp_path / "missing", "prometheus_client", "raise ImportError('hidden by the test')\n")
    done = subprocess.run(command, env=missing, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "--metrics-port needs prometheus-client" in done.stderr, done.stderr
    assert "pip install prometheus-client" in done.stderr, "names what to install, as pip knows it"
    assert not served.exists(), "refused before the socket was claimed"
    incomplete = _shadow(tmp_path / "incomplete", "prometheus_client", "REGISTRY = Counter = Histogram = None\n")
    done = subprocess.run(command, env=incomplete, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "which this Python cannot import (cannot import name 'core'" in \
        done.stderr and not served.exists(), "a part missing is found with the rest, before anything"
    failing = _shadow(tmp_path / "failing", "prometheus_client", "REGISTRY = Histogram = None\n"
                      "def Counter(*args):\n    raise RuntimeError('the metrics library failed')\n")
    (tmp_path / "failing" / "prometheus_client" / "exposition.py").write_text("MetricsHandler = object\n")
    (tmp_path / "failing" / "prometheus_client" / "core.py").write_text("")
    done = subprocess.run(command, env=failing, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "the metrics library failed" in done.stderr, done.stderr
    assert not served.exists(), "the bind failed after the socket was bound: nothing of it is left"
    status = subprocess.run([sys.executable, "-m", "peerd", "status", "--socket", str(served / "peerd.sock")],
                            capture_output=True, text=True, timeout=30)
    assert status.returncode == 3 and "no peerd daemon socket" in status.stdout + status.stderr, status


def test_a_daemon_that_fails_after_its_claim_leaves_no_lock_nor_the_directory_it_made(socket_dir):
    """A failure after the socket was claimed and before the bind left the lock file and the directory
    the daemon had made; a supervisor's bad watchdog setting is refused before anything is claimed."""
    from peerd.server import Daemon as Server
    from peerd.settings import Loader

    made = Path(socket_dir) / "made"
    env = {**os.environ, "NOTIFY_SOCKET": str(Path(socket_dir) / "notify"), "WATCHDOG_USEC": "soon"}
    done = subprocess.run([sys.executable, "-m", "peerd", "serve", "--backend", "host", "--socket",
                           str(made / "peerd.sock")], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "WATCHDOG_USEC='soon' is no count of microseconds" in done.stderr, done.stderr
    assert not made.exists(), "refused before the socket was claimed"

    class Failing:  # a backend that opens, then fails as the daemon is built around it
        closed = False

        def share_fd_room(self, room):
            raise RuntimeError("the backend failed")

        def close(self):
            Failing.closed = True

    settings, _ = Loader({"socket": str(made / "peerd.sock")}, default_file=None).load()
    with pytest.raises(RuntimeError, match="the backend failed"):
        Server(settings, Failing)
    assert Failing.closed and not made.exists(), "the backend closed, the claim gone with the directory it made"
