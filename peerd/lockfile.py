"""One daemon per socket path.

libzmq lets a second bind silently steal an ipc endpoint from a live daemon,
so the daemon first takes an exclusive flock on a file beside the socket. The
kernel drops the lock when its holder dies, which is what lets a daemon
restarted after a crash take over the stale socket without any cleanup step.

A stopping daemon removes the file before it lets go of the lock, so a
daemon that opened the file just before may lock a file no path names any
more, while a third creates and locks a new one: two daemons would serve.
A lock counts only on a file still linked, the one the path names; else the
open is tried again.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat


class AlreadyRunning(RuntimeError):
    """Another live daemon holds the lock."""


class UnsafeLockFile(RuntimeError):
    """The lock file cannot be taken: something other than a lock file is at its path, or it cannot be made."""


#: opens of a lock file that keeps being removed under the opener, before giving up
ATTEMPTS = 16


class SocketLock:
    def __init__(self, path: str):
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> None:
        for _ in range(ATTEMPTS):
            fd = self._lock_once()
            if fd is None:
                continue  # locked a file a stopping daemon had just removed: the path names another now
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            self._fd = fd
            return
        raise AlreadyRunning(f"the lock file {self.path} kept being replaced while this daemon took it: another "
                             "daemon is starting and stopping on this socket; stop it first")

    def _lock_once(self) -> int | None:
        """The fd of the file at the path, locked; None where it was removed meanwhile."""
        try:  # never through a planted symlink: the truncation would hit its target
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as err:
            if err.errno != errno.ELOOP:
                raise UnsafeLockFile(f"cannot open the lock file {self.path}: {err.strerror}: give another "
                                     "--socket, where this daemon may create files beside the socket") from None
            raise UnsafeLockFile(
                f"the lock file {self.path} is a symlink, which peerd never follows: remove it "
                "(no daemon made it), then start again"
            ) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise UnsafeLockFile(f"the lock file {self.path} is not a regular file: move it away, then start again")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise AlreadyRunning(
                f"another peerd (pid {holder}) already serves this socket (lock {self.path}); "
                "stop it first, or give this one another --socket"
            ) from None
        if os.fstat(fd).st_nlink == 0:  # removed since the open (inode numbers are no test: overlayfs and
            os.close(fd)               # NFS may give stat and fstat of one file different ones)
            return None
        return fd

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None
