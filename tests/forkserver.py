"""Rank processes forked from one that imported torch once: the integration tests' launcher.

A rank script (tests/rank.py and its siblings) spends about 1.5 s of CPU
starting, nearly all of it in `import torch`; with hundreds of ranks per run
that was most of the suite's time on a 2-core machine. The fork server
imports torch once (never CUDA: a process may fork before it touches CUDA,
not after) and forks each rank from itself, as vLLM's fork-mode workers are
born. A rank is still a process of its own with its own connection to the
daemon, memory, credentials, file descriptors and exit: the test gets a
``subprocess.Popen`` of it (pipes, wait, poll, communicate, signals), whose
exit status the server reports, as the rank is the server's child.

    python tests/forkserver.py SOCKET      # the server (conftest starts one per test run)
    popen([sys.executable, "tests/rank.py", ...], **popen_kwargs)   # a rank, forked where it can be

``popen`` runs anything else (another program, another interpreter setting, a
preexec_fn or a new session) as a plain ``subprocess.Popen``.
"""

from __future__ import annotations

import atexit
import fcntl
import io
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
STATUS = struct.Struct("=i")  # a pid, then the wait status
MAX_FDS = 16

#: what the server imported that a rank cannot change at its start: a launch whose environment
#: sets these otherwise runs as a plain process
_FIXED_AT_START = ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH", "PYTHONHASHSEED", "PYTHONDONTWRITEBYTECODE",
                   "LD_PRELOAD", "LD_LIBRARY_PATH")


# ---------------------------------------------------------------- the server


def serve(path: str) -> dict:
    """Fork a rank for each request on ``path``; report each one's wait status on its request's
    connection once it exits. Returns only in a forked child: its launch request."""
    import msgpack  # noqa: F401  the slow imports, once
    import numpy  # noqa: F401
    import torch  # noqa: F401
    import zmq  # noqa: F401

    warnings.filterwarnings("ignore", category=DeprecationWarning)  # fork() beside numpy's pool thread
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".new")
    listener.listen(64)
    os.rename(path + ".new", path)  # ready once it is there
    wake_r, wake_w = socket.socketpair()
    for s in (wake_r, wake_w):
        s.setblocking(False)
    signal.set_wakeup_fd(wake_w.fileno())
    signal.signal(signal.SIGCHLD, lambda *_: None)
    waiting: dict[int, socket.socket] = {}
    while True:
        readable = select.select([listener, wake_r], [], [])[0]
        if wake_r in readable:
            while _drained(wake_r):
                pass
        if listener in readable:
            conn, _ = listener.accept()
            launch, fds = _receive(conn)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for s in (listener, wake_r, wake_w, conn, *waiting.values()):
                    s.close()
                launch["fds"] = fds
                return launch
            for fd in fds:
                os.close(fd)
            conn.sendall(STATUS.pack(pid))
            waiting[pid] = conn
        _reap(waiting)


def _drained(sock: socket.socket) -> bool:
    try:
        return bool(sock.recv(4096))
    except BlockingIOError:
        return False


def _reap(waiting: dict[int, socket.socket]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = waiting.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(STATUS.pack(status))
            except OSError:
                pass  # the test gave up on it
            conn.close()


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, MAX_FDS)
    size = STATUS.unpack_from(data)[0]
    data = data[STATUS.size:]
    while len(data) < size:
        more = conn.recv(size - len(data))
        if not more:
            raise EOFError("the launch request was cut short")
        data += more
    return json.loads(data), fds


def become(launch: dict) -> None:
    """In the forked child: take the launch's file descriptors, environment, directory and argv,
    as an exec of ``python SCRIPT ARGS`` would have started with."""
    targets, fds = launch["targets"], launch["fds"]
    floor = max([*targets, *fds]) + 1  # out of the way of every target number first (os.dup takes the lowest)
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, floor) for fd in fds]
    for fd in fds:
        os.close(fd)
    for target, fd in zip(targets, high):
        os.dup2(fd, target)
    for fd in map(int, os.listdir("/proc/self/fd")):
        if fd > 2 and fd not in targets:
            try:
                os.close(fd)
            except OSError:
                pass  # the listing's own descriptor
    os.environ.clear()
    os.environ.update(launch["env"])
    os.chdir(launch["cwd"])
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
    sys.stdout = sys.__stdout__ = _writer(1, unbuffered, "strict")
    sys.stderr = sys.__stderr__ = _writer(2, unbuffered, "backslashreplace", line_buffering=True)
    sys.argv = launch["argv"][1:]
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
    import numpy

    numpy.random.seed()  # a fresh process seeds it from the OS; a fork would share the server's


def _writer(fd: int, unbuffered: bool, errors: str, line_buffering: bool = False) -> io.TextIOWrapper:
    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(io.BufferedWriter(raw), encoding="utf-8", errors=errors,
                            line_buffering=line_buffering or raw.isatty(), write_through=unbuffered)


# ---------------------------------------------------------------- the test's side


class Forked(subprocess.Popen):
    """A ``subprocess.Popen`` of a rank the fork server made: the server, its parent, reports
    its wait status on the launch's connection, which wait() and poll() read instead of waitpid."""

    def __init__(self, server: str, args, **kwargs):
        self._server = server
        super().__init__(args, **kwargs)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, *_):
        given = {0: p2cread, 1: c2pwrite, 2: errwrite}  # -1: the test's own, as an exec inherits it
        targets = {n: fd if fd != -1 else n for n, fd in given.items()}
        targets.update({fd: fd for fd in pass_fds})
        request = json.dumps({"argv": [os.fspath(a) for a in args], "cwd": os.path.abspath(os.fspath(cwd or ".")),
                              "env": dict(os.environ if env is None else env),
                              "targets": list(targets)}).encode()
        status = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            status.connect(self._server)
            socket.send_fds(status, [STATUS.pack(len(request)) + request], list(targets.values()))
            self.pid = STATUS.unpack(_exactly(status, STATUS.size))[0]
        except BaseException:
            status.close()
            raise
        finally:
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
        self._status = status
        self._child_created = True

    def _try_wait(self, wait_flags):
        self._status.setblocking(not wait_flags & os.WNOHANG)
        try:
            data = _exactly(self._status, STATUS.size)
        except BlockingIOError:
            return 0, 0
        self._status.close()
        return self.pid, STATUS.unpack(data)[0]

    def _internal_poll(self, _deadstate=None, **_):
        if self.returncode is None and self._waitpid_lock.acquire(False):
            try:
                if self.returncode is None:
                    pid, status = self._try_wait(os.WNOHANG)
                    if pid == self.pid:
                        self._handle_exitstatus(status)
            finally:
                self._waitpid_lock.release()
        return self.returncode


def _exactly(sock: socket.socket, size: int) -> bytes:
    data = sock.recv(size, socket.MSG_WAITALL)
    if len(data) != size:
        raise ChildProcessError("the fork server went away: this rank's exit status is lost")
    return data


class Server:
    """The fork server of this test run, started on first use."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.path = ""
        self.env: dict[str, str] = {}

    def start(self) -> str:
        if self.proc is None:
            folder = tempfile.mkdtemp(prefix="pd-fork-", dir="/tmp")
            self.path = os.path.join(folder, "fork.sock")
            self.env = dict(os.environ)
            self.proc = subprocess.Popen([sys.executable, __file__, self.path], stdin=subprocess.DEVNULL,
                                         stdout=open(os.path.join(folder, "server.log"), "ab"),
                                         stderr=subprocess.STDOUT, env=self.env)
            atexit.register(self.stop)
            deadline = time.monotonic() + 60
            while not os.path.exists(self.path):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the fork server did not start (exit {self.proc.poll()}): "
                                       f"{open(os.path.join(folder, 'server.log')).read()}")
                time.sleep(0.02)
        return self.path

    def takes(self, args, kwargs: dict) -> bool:
        """Whether this launch is a test script run by this interpreter, as a fork of the server can be."""
        if len(args) < 2 or args[0] != sys.executable or not os.fspath(args[1]).endswith(".py"):
            return False
        if os.path.dirname(os.path.abspath(os.fspath(args[1]))) != HERE:
            return False
        if any(kwargs.get(k) for k in ("preexec_fn", "start_new_session", "shell", "user", "group", "executable")):
            return False
        env = kwargs.get("env") or os.environ
        return all(env.get(k) == self.env.get(k, os.environ.get(k)) for k in _FIXED_AT_START)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.path:
            for leftover in (self.path, os.path.join(os.path.dirname(self.path), "server.log")):
                if os.path.exists(leftover):
                    os.unlink(leftover)
            os.rmdir(os.path.dirname(self.path))
        self.proc, self.path = None, ""


server = Server()


def popen(args, **kwargs) -> subprocess.Popen:
    """``subprocess.Popen(args, **kwargs)``; a test script of this interpreter is forked from the server."""
    if server.takes(args, kwargs):
        return Forked(server.start(), args, **kwargs)
    return subprocess.Popen(args, **kwargs)


if __name__ == "__main__":
    import runpy

    launch = serve(sys.argv[1])  # returns in each forked rank
    become(launch)
    runpy.run_path(sys.argv[0], run_name="__main__")
