"""Fixtures that run the real thing: a daemon process on a private socket,
worker ranks as separate processes (forked from one that imported torch once:
tests/forkserver.py), the CLI as a subprocess."""

from __future__ import annotations

import contextlib
import grp
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from peerd_client.connection import daemon_answers
from tests.forkserver import popen

HERE = Path(__file__).parent
MEMFD = "/memfd:peerd"  # how /proc shows the host backend's memory


def memfds(pid: int) -> dict[int, int]:
    """The host-backend memory process ``pid`` holds open: fd -> inode."""
    held = {}
    for entry in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if os.readlink(entry).startswith(MEMFD):
                held[int(entry.name)] = entry.stat().st_ino
        except OSError:  # closed meanwhile
            pass
    return held


def memfd_holders(inodes: set[int]) -> list[str]:
    """Every process that still holds one of these memfds, by fd or by mapping."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if inodes & set(memfds(int(proc.name)).values()):
                found.append(f"pid {proc.name} (fd)")
            for line in (proc / "maps").read_text().splitlines():
                fields = line.split()
                if len(fields) >= 6 and fields[5].startswith(MEMFD) and int(fields[4]) in inodes:
                    found.append(f"pid {proc.name} (mapping)")
                    break
        except OSError:  # gone meanwhile
            pass
    return found


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


@contextlib.contextmanager
def local_users(group: str, *names: str):
    """Real Unix users (no home, no login shell), members of group: created where missing, removed after.
    Yields each one's "uid:gid:group's gid", as tests/as_user.py and the ranks' --as-user take it."""
    created = []
    if not _exists(grp.getgrnam, group):
        subprocess.run(["groupadd", group], check=True)
        created.append(["groupdel", group])
    for name in names:
        if not _exists(pwd.getpwnam, name):
            subprocess.run(["useradd", "--no-create-home", "--user-group", "--shell", "/usr/sbin/nologin",
                            "--groups", group, name], check=True)
            created.insert(0, ["userdel", name])
    try:
        gid = grp.getgrnam(group).gr_gid
        yield {name: f"{pwd.getpwnam(name).pw_uid}:{pwd.getpwnam(name).pw_gid}:{gid}" for name in names}
    finally:
        for command in created:
            subprocess.run(command, check=False)


def _exists(lookup, name) -> bool:
    try:
        lookup(name)
        return True
    except KeyError:
        return False


#: a chunk goes back to the driver as soon as it is empty, so a test sees a set's memory freed on its release;
#: the tests of chunk reuse keep chunks with --arena-idle-s
ARENA_ENV = {"PEERD_ARENA_IDLE_S": "0"}


@dataclass
class Daemon:
    socket: str
    log: Path
    args: tuple[str, ...] = ()
    backend: str = "host"
    proc: subprocess.Popen | None = None
    extra_env: dict = field(default_factory=dict)  # for the daemon and the ranks
    daemon_env: dict = field(default_factory=dict)  # for the daemon alone
    launcher: tuple[str, ...] = ()  # what runs the daemon's command (unshare: a pid namespace of its own)

    def env(self) -> dict:
        return {**os.environ, "PEERD_SOCKET": self.socket, "PYTHONUNBUFFERED": "1", **ARENA_ENV, **self.extra_env}

    def start(self) -> "Daemon":
        self.proc = subprocess.Popen(
            [*self.launcher, sys.executable, "-m", "peerd", "serve", "--backend", self.backend, "--socket", self.socket,
             *self.args],
            stdout=open(self.log, "ab"),
            stderr=subprocess.STDOUT,
            env={**self.env(), "PEERD_LOG_LEVEL": "debug", **self.daemon_env},  # tests wait on per-rank lines
        )
        wait_until(lambda: daemon_answers(self.socket) or self.proc.poll() is not None, 20, "the daemon to answer")
        assert self.proc.poll() is None, f"daemon exited at start:\n{self.log.read_text()}"
        return self

    def stop(self) -> int:
        """SIGTERM; the exit code. Every error the daemon answered must be one its op declares
        (peerd/ops.py): each test that provokes an error checks the declarations too."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=20)
        undeclared = [line for line in self.logs().splitlines() if "does not declare" in line]
        assert not undeclared, "the daemon answered errors its ops do not declare:\n" + "\n".join(undeclared)
        return code

    def segments(self) -> list[int]:
        """Host buffers this daemon still holds: the inodes of its memfds."""
        return sorted(memfds(self.proc.pid).values())

    def settled_segments(self, timeout: float = 10) -> list[int]:
        """The segments still held once the closes under way ended: the daemon closes a freed chunk's
        memfd on a thread, after punching its pages out (peerd.backends.hostreserve)."""
        deadline = time.monotonic() + timeout
        while (held := self.segments()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return held

    def cli(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "peerd", *args], env=self.env(), capture_output=True, text=True, timeout=timeout
        )

    def logs(self) -> str:
        return self.log.read_text()


@pytest.fixture
def socket_dir():
    # short and private: unix socket paths must stay under 108 bytes
    path = tempfile.mkdtemp(prefix="pd-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def daemon(socket_dir):
    """A running host-backend daemon; on teardown it must stop cleanly and leave nothing."""
    d = Daemon(os.path.join(socket_dir, "peerd.sock"), Path(socket_dir) / "daemon.log").start()
    yield d
    held = set(d.segments())
    code = d.stop()
    assert code == 0, f"daemon exited {code}:\n{d.logs()}"
    wait_until(lambda: not memfd_holders(held), 10, "every process to let go of the daemon's memory")
    assert not os.path.exists(d.socket) and not os.path.exists(d.socket + ".fd"), "socket left after shutdown"


def start_rank(daemon: Daemon, scenario: str, rank: int, npes: int, *args: str, stdin=None) -> subprocess.Popen:
    return popen(
        [sys.executable, str(HERE / "rank.py"), scenario, "--rank", str(rank), "--npes", str(npes), *args],
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=daemon.env(),
    )


def finish(proc: subprocess.Popen, timeout: float = 90) -> dict:
    """The rank's result; a rank still running at ``timeout`` is killed and reaped first, so no test leaves
    one behind for a later test's process bookkeeping to trip on."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"rank did not finish within {timeout:g}s (killed):\n{out}\n{err}") from None
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, f"rank printed no result (exit {proc.returncode}):\n{out}\n{err}"
    return json.loads(lines[-1])


def run_ranks(daemon: Daemon, scenario: str, npes: int, *args: str, ranks=None, timeout: float = 90) -> list[dict]:
    """Start the ranks (all of them by default) at once; their results by rank. Where one fails to
    finish, the others are killed and reaped too."""
    procs = [start_rank(daemon, scenario, r, npes, *args) for r in (ranks if ranks is not None else range(npes))]
    try:
        return [finish(p, timeout) for p in procs]
    except BaseException:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        raise


def shadowed(root: Path, package: str, source: str) -> str:
    """A PYTHONPATH under which Python finds ``package`` as ``source`` (a broken, partial or missing install)
    ahead of the real one; packages shadowed under one ``root`` share it."""
    (root / package).mkdir(parents=True)
    (root / package / "__init__.py").write_text(source)
    return os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))


def child_of(pid: int) -> int:
    """The one child of ``pid`` (unshare's and nsenter's: the process they fork), once it is there."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    wait_until(lambda: children.read_text().split(), 10, f"pid {pid} to fork")
    return int(children.read_text().split()[0])
