"""The daemon's claim on its socket path, staked before its backend starts.

A second ``peerd serve`` on a socket a live daemon serves, or one whose
socket directory is unsafe, must fail before it costs anything: the cuda
backend starts a context on every GPU it serves (about 1 s and 260 MiB of
device memory each), and its own errors (no CUDA here) would hide the one
that matters. So the directory is checked (or made), the lock taken and
stale sockets removed first; the daemon binds once its backend is up.
"""

from __future__ import annotations

import contextlib
import os

from .access import give_to_group, prepare_socket_dir, remove_stale_socket
from .lockfile import SocketLock, UnsafeLockFile
from .paths import fd_socket_path, lock_path


class SocketClaim:
    """The socket's directory made safe, its lock held, what a gone daemon left there removed.

    Raises UnsafeSocketDirectory, UnsafeLockFile, AlreadyRunning,
    NotASocket or the OSError of an unlink, holding nothing then.
    """

    def __init__(self, path: str, dir_mode: int, gid: int | None):
        directory = os.path.dirname(path)
        self._lock = SocketLock(lock_path(path))
        self._made: str | None = None
        try:
            for last in (False, True):
                self._made = directory if prepare_socket_dir(directory, dir_mode, gid) else None
                try:
                    self._lock.acquire()
                    break
                except UnsafeLockFile:  # once more where a daemon stopping beside this one removed the
                    if last or os.path.isdir(directory):  # directory it had made, between this one's look and
                        raise  # its lock
            if gid is not None:  # the socket's group, tried on the lock file: refused now, not after the backend
                give_to_group(lock_path(path), gid)
            remove_stale_socket(path)
            remove_stale_socket(fd_socket_path(path))
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Let go of the lock (its file removed first: peerd.lockfile), then remove the socket directory
        if this claim made it and it is empty: left behind, a root daemon's /run/peerd (0750) read as the
        node's daemon to every other user's default socket (peerd.paths), after it stopped. Idempotent."""
        self._lock.release()
        made, self._made = self._made, None
        if made is not None:
            with contextlib.suppress(OSError):  # not empty: another daemon's socket, or a file someone put there
                os.rmdir(made)
