"""The pid watcher, both ways: a pidfd turning readable, and polling where pidfd_open is missing."""

from __future__ import annotations

import select
import subprocess
import sys
import time

from peerd.liveness import POLL_INTERVAL, PidWatcher


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_a_pidfd_turns_readable_when_the_process_dies():
    watcher, child = PidWatcher(), _sleeper()
    fd = watcher.watch(child.pid)
    assert fd is not None and watcher.watch(child.pid) is None, "one pidfd per pid"
    assert select.select([fd], [], [], 0)[0] == []
    child.kill()
    child.wait()
    assert select.select([fd], [], [], 5)[0] == [fd]
    assert watcher.died(fd) == child.pid and watcher.fds == {}


def test_polling_finds_the_dead_where_pidfd_open_is_missing():
    watcher, child = PidWatcher(), _sleeper()
    watcher.polling = True
    assert watcher.watch(child.pid) is None
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
    assert watcher.watch(child.pid) is None
    assert watcher.sweep() == [child.pid]
