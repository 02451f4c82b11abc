"""One daemon per socket path: the lock beside the socket, against a stopping daemon's removal of it."""

from __future__ import annotations

import fcntl
import os

import pytest

from peerd import lockfile
from peerd.lockfile import AlreadyRunning, SocketLock


def test_a_second_daemon_is_refused_naming_the_first(tmp_path):
    path = str(tmp_path / "peerd.sock.lock")
    first = SocketLock(path)
    first.acquire()
    with pytest.raises(AlreadyRunning, match=f"pid {os.getpid()}"):
        SocketLock(path).acquire()
    first.release()
    again = SocketLock(path)
    again.acquire()
    again.release()
    assert not os.path.exists(path)


def test_a_lock_taken_on_a_file_a_stopping_daemon_removed_is_taken_again_on_the_one_the_path_names(
        tmp_path, monkeypatch):
    """The stopping daemon removes the file, then lets go: one starting just then locked the removed file
    while a third created and locked a new one, and both served."""
    path = str(tmp_path / "peerd.sock.lock")
    real_flock, removed = fcntl.flock, []

    def flock_after_removal(fd, operation):
        if not removed:  # the first daemon's release lands between our open and our lock
            os.unlink(path)
            removed.append(fd)
        return real_flock(fd, operation)

    monkeypatch.setattr(lockfile.fcntl, "flock", flock_after_removal)
    starting = SocketLock(path)
    starting.acquire()
    monkeypatch.setattr(lockfile.fcntl, "flock", real_flock)
    assert os.fstat(starting._fd).st_ino == os.stat(path).st_ino, "it holds the file the path names"
    with pytest.raises(AlreadyRunning):
        SocketLock(path).acquire()  # the third daemon
    starting.release()


def test_a_claim_whose_new_directory_a_stopping_daemon_removed_makes_it_again(tmp_path, monkeypatch):
    """A daemon removes the socket directory it made when it stops: one starting beside it, which found the
    directory there, then failed to create its lock file in it ('No such file or directory')."""
    from peerd import socketclaim

    directory = tmp_path / "run"
    prepare = socketclaim.prepare_socket_dir
    looks = []

    def removed_after_the_look(*args):
        made = prepare(*args)
        looks.append(made)
        if len(looks) == 1:
            os.rmdir(directory)  # the stopping daemon's release, between this one's look and its lock
        return made

    monkeypatch.setattr(socketclaim, "prepare_socket_dir", removed_after_the_look)
    claim = socketclaim.SocketClaim(str(directory / "peerd.sock"), 0o750, None)
    assert looks == [True, True] and os.path.exists(directory / "peerd.sock.lock")
    claim.release()
    assert not directory.exists(), "made by this claim (again), so removed by it"
