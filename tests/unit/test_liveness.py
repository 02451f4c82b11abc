"""The pid watcher, both ways: a pidfd turning readable, and polling where pidfd_open is missing."""

from __future__ import annotations

import errno
import os
import select
import subprocess
import sys
import time

import pytest

from peerd import liveness
from peerd.liveness import POLL_INTERVAL, PidWatcher


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_a_pidfd_turns_readable_when_the_process_dies():
    watcher, child = PidWatcher(), _sleeper()
    fd = watcher.watch(child.pid, 1000)
    assert fd is not None and watcher.watch(child.pid, 1000) is None, "one pidfd per pid"
    assert select.select([fd], [], [], 0)[0] == []
    child.kill()
    child.wait()
    assert select.select([fd], [], [], 5)[0] == [fd]
    assert watcher.died(fd) == child.pid and watcher.fds == {}


def test_polling_finds_the_dead_where_pidfd_open_is_missing():
    watcher, child = PidWatcher(), _sleeper()
    watcher.polling = True
    assert watcher.watch(child.pid, 1000) is None
    assert watcher.sweep() == []
    child.kill()
    child.wait()
    deadline = time.monotonic() + 5
    while not (dead := watcher.sweep()) and time.monotonic() < deadline:
        time.sleep(POLL_INTERVAL)
    assert dead == [child.pid] and watcher.sweep() == []


def test_a_pid_already_gone_is_reported_at_once():
    watcher, child = PidWatcher(), _sleeper()
    child.kill()
    child.wait()
    assert watcher.watch(child.pid, 1000) is None
    assert watcher.sweep() == [child.pid]


def test_a_uid_gets_at_most_its_share_of_watched_processes_and_a_death_frees_a_place():
    watcher, children = PidWatcher(max_per_uid=2), [_sleeper() for _ in range(3)]
    try:
        for child in children[:2]:
            assert watcher.refusal(child.pid, 1000) is None
            watcher.watch(child.pid, 1000)
        assert watcher.refusal(children[0].pid, 1000) is None, "a process already watched is never refused"
        refused = watcher.refusal(children[2].pid, 1000)
        assert refused == (f"uid 1000 already has 2 live processes holding or waiting on something in the daemon "
                           f"(at most 2, --max-processes-per-uid); pid {children[2].pid} is refused: try again "
                           "once some of them exit")
        assert watcher.refusal(children[2].pid, 1001) is None, "another uid has its own share"
        children[0].kill()
        children[0].wait()
        (fd,) = [fd for fd, pid in watcher.fds.items() if pid == children[0].pid]
        assert select.select([fd], [], [], 5)[0] == [fd] and watcher.died(fd) == children[0].pid
        assert watcher.refusal(children[2].pid, 1000) is None, "the death gave its place back"
    finally:
        for child in children:
            child.kill()
            child.wait()
        watcher.close()


def test_no_fd_for_a_pidfd_now_refuses_that_pid_and_keeps_pidfds_on_for_the_rest(monkeypatch):
    """Any pidfd_open error switched the daemon to polling pids for good, with its pid-reuse windows, for
    every process (a pid of 0, or EMFILE once); only a kernel without pidfds does now."""
    def no_fd(pid):
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    watcher, child = PidWatcher(), _sleeper()
    real = os.pidfd_open
    monkeypatch.setattr(liveness.os, "pidfd_open", no_fd)
    with pytest.raises(OSError):
        watcher.watch(child.pid, 1000)
    assert not watcher.polling and watcher.refusal(child.pid, 1000) is None and not watcher._uid_of
    monkeypatch.setattr(liveness.os, "pidfd_open", real)
    try:
        assert watcher.watch(child.pid, 1000) is not None, "watched by a pidfd once one can be had"
    finally:
        child.kill()
        child.wait()
        watcher.close()
