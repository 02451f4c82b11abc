"""`peerd run`: a private daemon for exactly one job's lifetime.

Where no system-wide peerd runs (a laptop, a container, a batch job),
`peerd run [serve options] -- CMD` starts a daemon on a socket in a fresh
directory of its own, waits until it answers, runs CMD with PEERD_SOCKET pointing
at it, and once CMD has exited stops the daemon (every buffer freed) and
removes the directory.

The daemon is a child process, `python -m peerd serve`, so its crash cannot
take the launcher down: the launcher says so in one line, lets CMD finish
(its next peerd call raises DaemonUnavailable) and exits 125. The daemon
runs in a session of its own, so neither the terminal's Ctrl-C, Ctrl-Z and
hangup nor signals sent to the job's process group reach it: it outlives the
job's own shutdown (ranks releasing on their way out) and is stopped only
after CMD has exited. PR_SET_PDEATHSIG stops it should the launcher itself be
SIGKILLed.

CMD stays in the launcher's process group, which a shell makes the
terminal's foreground group, so CMD behaves as it would without peerd run:
it keeps the terminal (input, pdb in a rank, Ctrl-Z and fg), and Ctrl-C
reaches torchrun and every rank straight from the terminal, exactly once. A
signal the kernel raised for the terminal (si_code SI_KERNEL: Ctrl-C,
hangup) is therefore not forwarded, since CMD has it already; SIGINT, SIGTERM
or SIGHUP that a process sent to the launcher (kill, a container runtime, a
scheduler) is forwarded to CMD. A signal sent to a whole process group or
cgroup at once (`kill -TERM -PGID`, bash's `kill %1`, systemd's stop, Slurm's
scancel) reaches CMD both directly and through the launcher, as with any
launcher that forwards signals.

Exit status: CMD's; 128+N when CMD died of signal N; 125 when peerd run
itself failed (the daemon did not start, died before CMD ended, or did not
stop cleanly); 126 when CMD cannot be executed and 127 when it is not found,
as env(1) and timeout(1) report them.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .ownpython import CHILD_CWD, python_child
from .paths import check_socket_path
from .settings import OPTIONS, Loader, OctalMode, Option, Settings

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
WATCHED = {*FORWARDED, signal.SIGCHLD}
SI_KERNEL = 0x80  # Linux's si_code for a signal the kernel raised, e.g. the terminal's Ctrl-C
#: the daemon creates this directory in the launcher's and puts its socket there: it sets the mode
#: and group only of a directory it created
SOCKET_NAME = os.path.join("run", "peerd.sock")
START_TIMEOUT_S = 30.0
STOP_MARGIN_S = 10.0  # beyond the daemon's shutdown grace, before SIGKILL
EXIT_FAILED, EXIT_CANNOT_EXECUTE, EXIT_NOT_FOUND = 125, 126, 127
PR_SET_PDEATHSIG = 1

_libc = ctypes.CDLL(None, use_errno=True)  # loaded here: a forked child must not dlopen


class LaunchFailed(Exception):
    """peerd run could not run the job under a daemon of its own; the message says why."""

    def __init__(self, message: str, status: int = EXIT_FAILED):
        super().__init__(message)
        self.status = status


def launch(settings: Settings, loader: Loader, command: Sequence[str]) -> int:
    """Run command under a private daemon; the status peerd run exits with.

    ``loader`` holds the serve options given to peerd run, passed on to the
    daemon; ``settings`` is what they resolve to. Leaves SIGINT, SIGTERM,
    SIGHUP and SIGCHLD blocked, to be taken by sigwaitinfo: the caller exits
    right after.
    """
    signal.pthread_sigmask(signal.SIG_BLOCK, WATCHED)
    try:
        stop_timeout = settings.shutdown_grace + STOP_MARGIN_S
        with private_daemon(lambda socket: serve_argv(loader, socket), stop_timeout) as daemon:
            status = _run_job(command, daemon)
        return EXIT_FAILED if daemon.failed else status
    except LaunchFailed as err:
        _say(str(err))
        return err.status


@contextlib.contextmanager
def private_daemon(argv_for: Callable[[str], list[str]], stop_timeout: float) -> Iterator["JobDaemon"]:
    """A daemon serving a socket in a fresh private directory while the block runs.

    ``argv_for(socket)`` gives its `peerd serve` options. It reads no
    configuration file unless they or PEERD_CONFIG name one: the node's
    /etc/peerd/peerd.toml is the node service's (its metrics port, its
    socket group) and would make every job's daemon fail to start. It is
    stopped (every buffer freed) and the directory removed when the block
    ends, however it ends; LaunchFailed if it never answers.
    """
    directory = _private_dir()
    try:
        socket = os.path.join(directory, SOCKET_NAME)
        argv = argv_for(socket)
        if "--config" not in argv:  # PEERD_CONFIG's path made absolute: the daemon starts in /
            named = os.environ.get("PEERD_CONFIG")
            argv = ["--config", os.path.abspath(named) if named else _empty_config(directory), *argv]
        daemon = JobDaemon(argv, socket, stop_timeout)
        try:
            daemon.wait_until_serving()
            yield daemon
        finally:
            daemon.stop()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def serve_argv(loader: Loader, socket: str) -> list[str]:
    """`peerd serve` options for the job's daemon: the ones peerd run was given, on our socket.

    Only what the command line said is passed on: the daemon reads the same
    environment, and the configuration file --config names (no other: see
    private_daemon), so it resolves the same settings.
    The directory stays 0700 unless --socket-dir-mode says otherwise.
    """
    given = {**loader.given, "socket": socket}
    if given["socket_dir_mode"] is None:
        given["socket_dir_mode"] = 0o700
    argv = ["--config", os.path.abspath(loader.config)] if loader.config else []  # the daemon starts in /
    for option in OPTIONS:
        value = given[option.name]
        if value is None:  # not given
            continue
        for one in value if option.multiple else (value,):
            argv += [option.flag, _as_text(option, one)]
    return argv


def _as_text(option: Option, value: Any) -> str:
    return f"{value:o}" if isinstance(option.type, OctalMode) else str(value)


class JobDaemon:
    """The job's `peerd serve` child, in a session of its own."""

    def __init__(self, argv: list[str], socket: str, stop_timeout: float):
        self.socket = socket
        self.stop_timeout = stop_timeout
        self.failed = False  # it did not serve the whole job, or did not stop cleanly
        command, env = python_child("peerd", "serve", *argv)
        self.proc = subprocess.Popen(
            command,
            env=env,
            cwd=CHILD_CWD,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_unblock_and_die_with_parent,
        )

    def wait_until_serving(self) -> None:
        """Return once it answers; LaunchFailed if it exits, never answers, or a signal comes first."""
        from peerd_client.connection import daemon_answers

        deadline = time.monotonic() + START_TIMEOUT_S
        while not daemon_answers(self.socket):
            if self.proc.poll() is not None:
                raise LaunchFailed(f"the daemon {self._ended()} before it answered on {self.socket}; its log is above")
            if time.monotonic() > deadline:
                raise LaunchFailed(
                    f"the daemon did not answer on {self.socket} within {START_TIMEOUT_S:g}s; its log is above"
                )
            info = signal.sigtimedwait(WATCHED, 0.05)
            if info is not None and info.si_signo in FORWARDED:
                name = signal.Signals(info.si_signo).name
                raise LaunchFailed(f"{name} before the job started: nothing was run", 128 + info.si_signo)

    def check(self) -> None:
        """Say, once, that the daemon died under the job."""
        if not self.failed and self.proc.poll() is not None:
            self.failed = True
            _say(
                f"the daemon (pid {self.proc.pid}) {self._ended()} while the job ran: its buffers are gone, "
                f"the job's next peerd call raises DaemonUnavailable; exiting {EXIT_FAILED} once the job ends"
            )

    def stop(self) -> None:
        """SIGTERM (it drains), SIGKILL if it outstays its grace.

        Nothing to sweep after an unclean stop: host memory has no name, and
        the kernel frees it once the daemon and the job are gone.
        """
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            if self.proc.returncode != 0:
                self.failed = True
                _say(f"the daemon (pid {self.proc.pid}) {self._ended()} when asked to stop; its log is above")

    def _ended(self) -> str:
        code = self.proc.returncode
        return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"


def _run_job(command: Sequence[str], daemon: JobDaemon) -> int:
    """Run CMD to its end, forwarding the signals it did not get itself; its exit status."""
    try:
        job = subprocess.Popen(
            list(command), env={**os.environ, "PEERD_SOCKET": daemon.socket}, preexec_fn=_unblock
        )
    except FileNotFoundError:
        raise LaunchFailed(f"cannot run {command[0]!r}: no such command", EXIT_NOT_FOUND) from None
    except OSError as err:
        raise LaunchFailed(f"cannot run {command[0]!r}: {err.strerror}", EXIT_CANNOT_EXECUTE) from None
    while job.poll() is None:
        info = signal.sigwaitinfo(WATCHED)  # SIGCHLD wakes it when either child ends
        if info.si_signo in FORWARDED and info.si_code != SI_KERNEL:
            job.send_signal(info.si_signo)
        daemon.check()
    daemon.check()
    return 128 - job.returncode if job.returncode < 0 else job.returncode


def _empty_config(directory: str) -> str:
    """An empty configuration file in the job's private directory: the job's daemon reads it, not the node's."""
    path = os.path.join(directory, "peerd.toml")
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    return path


def _private_dir() -> str:
    """A fresh directory whose socket path (and its fd channel's) fits a unix socket.

    0711: others may pass through it to the daemon's own directory inside,
    which has the job's --socket-dir-mode (0700 unless given), but not list it.
    """
    for base in dict.fromkeys(filter(None, (os.environ.get("XDG_RUNTIME_DIR"), tempfile.gettempdir(), "/tmp"))):
        try:
            directory = tempfile.mkdtemp(prefix="peerd-run-", dir=base)
        except OSError:
            continue
        os.chmod(directory, 0o711)
        try:
            check_socket_path(os.path.join(directory, SOCKET_NAME))
            return directory
        except ValueError:
            os.rmdir(directory)
    raise LaunchFailed(
        "found no writable directory short enough for a unix socket path among $XDG_RUNTIME_DIR, $TMPDIR "
        "and /tmp; point TMPDIR at a short one"
    )



# preexec_fn is safe here: the launcher has no other thread when it starts a
# child (the readiness check's ZeroMQ threads end with its connection).


def _unblock() -> None:
    """In a child before exec: a blocked signal mask survives exec, and CMD must get its signals."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, WATCHED)


def _unblock_and_die_with_parent() -> None:
    """Also SIGTERM the daemon when the launcher dies, even of SIGKILL."""
    _unblock()
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _say(message: str) -> None:
    print(f"peerd run: {message}", file=sys.stderr, flush=True)
