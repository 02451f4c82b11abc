"""`peerd run` as a user runs it: the launcher, its daemon and the job as real processes."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import signal
import stat
import subprocess
import sys
import termios

import click
import pytest

from peerd.launcher import serve_argv
from peerd.settings import Loader, Settings, serve_options
from tests.conftest import HERE, memfd_holders, memfds, shadowed, wait_until

PATIENCE_S = 90  # what a loaded 2-core machine may need to start four torch processes


def launch(*command: str, serve: tuple[str, ...] = (), env: dict | None = None, **popen) -> subprocess.Popen:
    """`peerd run` with a host-backend daemon; the PEERD_SOCKET it inherits points nowhere."""
    popen.setdefault("stdin", subprocess.PIPE)
    return subprocess.Popen(
        [sys.executable, "-m", "peerd", "run", "--backend", "host", *serve, "--", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PEERD_SOCKET": "/nonexistent/peerd.sock", "PYTHONUNBUFFERED": "1", **(env or {})},
        **popen,
    )


def rank(scenario: str, *args: str, npes: int = 1) -> list[str]:
    return [sys.executable, str(HERE / "rank.py"), scenario, "--rank", "0", "--npes", str(npes), *args]


def ready(proc: subprocess.Popen, timeout: float = PATIENCE_S) -> dict:
    """What the job printed on its READY line, and the memory its daemon held then."""
    if not select.select([proc.stdout], [], [], timeout)[0]:
        proc.kill()
        raise AssertionError(f"the job printed nothing within {timeout}s:\n{proc.communicate()[1]}")
    line = proc.stdout.readline()
    assert line.startswith("READY"), f"{line!r}\n{proc.communicate()[1]}"
    where = json.loads(line[len("READY"):].strip() or "{}")
    if "daemon" in where:
        where["memory"] = set(memfds(where["daemon"]).values())
    return where


def finish(proc: subprocess.Popen, stdin: str | None = None) -> tuple[dict, str]:
    """The job's JSON result and peerd run's stderr."""
    out, err = proc.communicate(stdin, timeout=PATIENCE_S)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    return (json.loads(lines[-1]) if lines else {}), err


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def assert_nothing_left(where: dict) -> None:
    assert not os.path.exists(os.path.dirname(where["socket"])), "socket directory left behind"
    assert not alive(where["daemon"]), "daemon left running"
    wait_until(lambda: not memfd_holders(where.get("memory", set())), 10, "every process to let go of the job's memory")


def test_a_job_of_four_ranks_shares_its_daemon_and_leaves_nothing():
    proc = launch(*rank("job", "--group", "launched", npes=4))
    result, err = finish(proc)
    assert proc.returncode == 0, err
    assert result["ok"], result
    assert [r["rank"] for r in result["ranks"]] == [0, 1, 2, 3]
    for r in result["ranks"]:
        assert r["ok"] and r["zero"] and r["closed"], r
        assert r["seen"] == [[peer + 1, peer + 1] for peer in range(4)], r
    assert result["socket"] != "/nonexistent/peerd.sock"
    assert_nothing_left(result)


def test_exit_codes_pass_through():
    done = subprocess.run(
        [sys.executable, "-m", "peerd", "run", "--backend", "host", "--log-level", "warning", "--",
         sys.executable, "-c", "raise SystemExit(7)"],
        capture_output=True, text=True, timeout=PATIENCE_S,
    )
    assert done.returncode == 7, done.stderr
    missing = launch("peerd-test-no-such-command")
    _, err = finish(missing)
    assert missing.returncode == 127
    assert "peerd run: cannot run 'peerd-test-no-such-command': no such command" in err


def test_a_killed_job_gives_128_plus_its_signal_and_leaves_nothing():
    proc = launch(*rank("held"))
    where = ready(proc)
    assert stat.S_IMODE(os.stat(os.path.dirname(where["socket"])).st_mode) == 0o700
    assert where["memory"], "the job's buffer should exist"
    os.kill(where["pid"], signal.SIGKILL)
    _, err = finish(proc)
    assert proc.returncode == 128 + signal.SIGKILL, err
    assert_nothing_left(where)


def test_sigterm_to_peerd_run_stops_the_job_then_the_daemon():
    proc = launch(*rank("held"))
    where = ready(proc)
    proc.send_signal(signal.SIGTERM)
    _, err = finish(proc)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert not alive(where["pid"])
    assert_nothing_left(where)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signal_sent_to_peerd_run_reaches_the_job_once(sig):
    proc = launch(*rank("signals"))
    ready(proc)
    proc.send_signal(sig)
    result, err = finish(proc)
    assert proc.returncode == 0, err
    assert result["received"] == [sig.name]


def test_ctrl_c_at_a_terminal_reaches_the_job_once():
    """The terminal signals the whole foreground group; peerd run must not add a second SIGINT."""
    controller, terminal = os.openpty()
    try:
        proc = launch(
            *rank("signals"),
            stdin=terminal,
            start_new_session=True,
            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),  # our pty becomes its terminal
        )
        ready(proc)
        os.write(controller, b"\x03")  # Ctrl-C
        result, err = finish(proc)
    finally:
        os.close(controller)
        os.close(terminal)
    assert proc.returncode == 0, err
    assert result["received"] == ["SIGINT"]


def test_a_daemon_that_dies_first_is_reported_and_the_job_told():
    proc = launch(*rank("held"))
    where = ready(proc)
    os.kill(where["daemon"], signal.SIGKILL)
    wait_until(lambda: not alive(where["daemon"]), 10, "peerd run to reap its daemon")
    result, err = finish(proc, stdin="go on\n")
    assert proc.returncode == 125, err
    assert "went away" in result["after"], result
    reports = [line for line in err.splitlines() if line.startswith("peerd run:")]
    assert len(reports) == 1 and f"the daemon (pid {where['daemon']}) was killed by SIGKILL" in reports[0], err
    assert_nothing_left(where)


def test_a_daemon_that_cannot_start_is_reported_and_nothing_runs(tmp_path):
    """Its backend cannot open: only the daemon finds that. hip-python is hidden from the daemon (on a ROCm
    host it would load), so the hip backend fails to open on any machine."""
    hidden = [shadowed(tmp_path, package, "raise ImportError('hidden by the test')\n") for package in ("rocm", "hip")]
    proc = launch(sys.executable, "-c", "print('ran')", serve=("--backend", "hip"), env={"PYTHONPATH": hidden[-1]})
    out, err = proc.communicate(timeout=PATIENCE_S)
    assert proc.returncode == 125 and "ran" not in out
    assert "libamdhip64 could not be loaded (hidden by the test)" in err, err
    assert "peerd run: the daemon exited with code 1 before it answered" in err


def test_settings_naming_no_group_are_refused_before_a_daemon_starts():
    proc = launch(sys.executable, "-c", "print('ran')", serve=("--socket-group", "peerd-test-no-such-group"))
    out, err = proc.communicate(timeout=PATIENCE_S)
    assert proc.returncode == 125 and "ran" not in out
    assert "command line: no such group 'peerd-test-no-such-group' (socket_group, --socket-group)" in err, err
    assert "the daemon exited" not in err, "refused with the other bad values, not by a daemon started for it"


def test_socket_is_the_launchers_to_choose():
    done = subprocess.run([sys.executable, "-m", "peerd", "run", "--socket", "/tmp/x.sock", "--", "true"],
                          capture_output=True, text=True, timeout=PATIENCE_S)
    assert done.returncode == 125 and "drop --socket" in done.stderr


@pytest.mark.parametrize("inherited", ["", "@abstract", "/" + "x" * 120])
def test_a_peerd_socket_the_launcher_does_not_serve_is_no_reason_to_refuse_the_job(inherited):
    """`peerd run` serves a socket of its own: an inherited PEERD_SOCKET no daemon could serve (empty,
    abstract, too long) is not its to check."""
    proc = launch(sys.executable, "-c", "print('ran')", env={"PEERD_SOCKET": inherited})
    out, err = proc.communicate(timeout=PATIENCE_S)
    assert proc.returncode == 0 and "ran" in out, err


@pytest.mark.parametrize("args, env, says", [
    (("--config", "/nonexistent/peerd.toml"), {}, "configuration file /nonexistent/peerd.toml does not exist"),
    ((), {"PEERD_MAX_GROUPS": "abc"}, "environment (PEERD_MAX_GROUPS): bad value"),
    (("--backend", "foo"), {}, "Invalid value for '--backend'"),
])
def test_peerd_runs_own_failures_exit_125_never_a_status_the_job_could_have(args, env, says):
    """Bad options, settings or environment exited 1 or 2: a wrapper could not tell them from the job's own."""
    done = subprocess.run([sys.executable, "-m", "peerd", "run", *args, "--", sys.executable, "-c", "print('ran')"],
                          capture_output=True, text=True, timeout=PATIENCE_S, env={**os.environ, **env})
    assert done.returncode == 125 and says in done.stderr and "ran" not in done.stdout, done


def test_the_daemon_gets_the_serve_options_given_to_peerd_run(tmp_path):
    @click.command()
    @serve_options
    def parse(settings: Settings) -> Loader:
        return click.get_current_context().meta["peerd.loader"]

    config = tmp_path / "peerd.toml"
    config.write_text('backend = "host"\n')
    options = ["--config", str(config), "--log-level", "debug", "--rendezvous-timeout", "1.5", "--socket-group", "0",
               "--allow-uid", "5", "--allow-uid", "6", "--max-bytes-per-uid", "4KiB", "--shutdown-grace", "2"]
    given = parse.main(options, standalone_mode=False)
    passed_on = parse.main(serve_argv(given, "/tmp/x.sock"), standalone_mode=False)
    assert passed_on.config == str(config)
    assert passed_on.given == {**given.given, "socket": "/tmp/x.sock", "socket_dir_mode": 0o700}
    chosen = parse.main(["--socket-dir-mode", "0750"], standalone_mode=False)
    assert parse.main(serve_argv(chosen, "/tmp/x.sock"), standalone_mode=False).given["socket_dir_mode"] == 0o750


PLANTED = {"peerd": "__main__.py", "peerd_client": "selftest.py"}


@pytest.mark.parametrize("command", [["selftest", "--ranks", "2"], ["run", "--backend", "host", "--", "true"]],
                         ids=["selftest", "run"])
def test_code_planted_in_the_current_directory_never_runs(socket_dir, tmp_path, command):
    """Both commands started their own Python children (the private daemon, the selftest's workers) with
    `python -m`, which looks in the current directory first: run from a directory another user can write
    (/tmp), a planted peerd/__main__.py or peerd_client/selftest.py ran as the caller, root included."""
    planted = tmp_path / "shared"
    for package, module in PLANTED.items():
        (planted / package).mkdir(parents=True)
        (planted / package / "__init__.py").write_text("")
        (planted / package / module).write_text(f"open({str(planted / 'ran')!r}, 'a').write({package!r})\n")
    peerd = os.path.join(os.path.dirname(sys.executable), "peerd")  # the console script, as a user types it
    assert os.access(peerd, os.X_OK), f"{peerd}: install peerd (pip install -e .) to run this test"
    done = subprocess.run([peerd, *command], cwd=planted, capture_output=True, text=True, timeout=PATIENCE_S,
                          env={**os.environ, "PEERD_SOCKET": os.path.join(socket_dir, "none.sock")})
    assert not (planted / "ran").exists(), f"planted code ran: {(planted / 'ran').read_text()}"
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_jobs_daemon_reads_no_configuration_file_but_the_one_named():
    """The node's /etc/peerd/peerd.toml is the node service's: its socket group (which a user need not be
    in) made every job's daemon fail to start, and its metrics port clashed with the service's. A file
    --config names is still read."""
    from peerd.settings import DEFAULT_CONFIG

    if os.path.exists(DEFAULT_CONFIG) or os.geteuid() != 0:
        pytest.skip(f"needs root and no {DEFAULT_CONFIG} of the machine's own (CI runs as root on a clean machine)")
    os.makedirs(os.path.dirname(DEFAULT_CONFIG), exist_ok=True)
    try:
        with open(DEFAULT_CONFIG, "w") as node:  # a group the job's daemon cannot take; a grace it must not use
            node.write('socket_group = "peerd-test-no-such-group"\nshutdown_grace = -1\n')
        ran = subprocess.run([sys.executable, "-m", "peerd", "run", "--backend", "host", "--", "true"],
                             capture_output=True, text=True, timeout=PATIENCE_S)
        assert ran.returncode == 0, ran.stderr  # neither peerd run nor its daemon read the node's file
        named = subprocess.run([sys.executable, "-m", "peerd", "run", "--config", DEFAULT_CONFIG, "--backend",
                                "host", "--", "true"], capture_output=True, text=True, timeout=PATIENCE_S)
        assert named.returncode != 0 and "shutdown_grace" in named.stderr, named.stderr
    finally:
        os.unlink(DEFAULT_CONFIG)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(DEFAULT_CONFIG))


def test_a_relative_peerd_config_is_the_callers(tmp_path):
    """The job's daemon starts in /: PEERD_CONFIG=rel.toml named /rel.toml there."""
    (tmp_path / "rel.toml").write_text('log_level = "warning"\n')
    ran = subprocess.run([sys.executable, "-m", "peerd", "run", "--backend", "host", "--", "true"], cwd=tmp_path,
                         env={**os.environ, "PEERD_CONFIG": "rel.toml"}, capture_output=True, text=True,
                         timeout=PATIENCE_S)
    assert ran.returncode == 0, ran.stderr
