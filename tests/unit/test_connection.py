"""The client connection's requests left by other threads (finalizers): never stranded, never blocking."""

from __future__ import annotations

import collections
import socket
import threading

from peerd_client.connection import Connection


def bare_connection(sent: list) -> Connection:
    """A Connection without a daemon: what it would send is appended to ``sent``."""
    conn = Connection.__new__(Connection)
    conn._lock, conn._owner, conn._lost = threading.Lock(), None, None
    conn._deferred = collections.deque()
    conn._wake_r, conn._wake_w = socket.socketpair()
    conn._wake_r.setblocking(False)
    conn._wake_w.setblocking(False)
    conn._check_lost = lambda: None
    conn._send = lambda op, body: sent.append(body["who"])
    return conn


def test_a_request_left_while_another_thread_sends_the_deferred_ones_is_sent_too():
    """The lost wake-up: thread T1 has sent what was left and not yet let go of the socket when a
    finalizer on T2 leaves a release, fails to take the socket, and returns. T1 looks again after it
    lets go, so the release goes out."""
    sent: list = []
    conn = bare_connection(sent)
    drain, raced = Connection._send_deferred, []

    def drain_then_race(self=conn):
        drain(self)
        if threading.current_thread().name == "T1" and not raced:
            raced.append(True)
            racer = threading.Thread(target=conn.send_later, args=("release", {"who": "T2"}), name="T2")
            racer.start()
            racer.join()

    conn._send_deferred = drain_then_race
    first = threading.Thread(target=conn.send_later, args=("release", {"who": "T1"}), name="T1")
    first.start()
    first.join(10)
    assert sent == ["T1", "T2"] and not conn._deferred


def test_a_finalizer_never_waits_for_a_thread_inside_a_call():
    sent: list = []
    conn = bare_connection(sent)
    with conn._lock:  # another thread is inside a long call
        done = threading.Thread(target=conn.send_later, args=("release", {"who": "finalizer"}))
        done.start()
        done.join(2)
        assert not done.is_alive() and sent == [], "it returned at once, leaving the release to the holder"
        assert conn._wake_r.recv(16) == b"\0", "and woke the holder"
    conn._flush_deferred()  # what the holder does as it lets go
    assert sent == ["finalizer"]



def test_a_connection_is_handed_out_only_once_the_retry_threads_release_went_out(monkeypatch):
    """A join that failed as the daemon went away queued a release of whatever this process held for the
    slot. The retry thread took it (the queue empty then, or the fresh connection its own) and, preempted
    before it sent it, let the next PeerBuffer's join go out first: the release then freed the new set.
    connection() returns only once the retry thread's flush is done, so the release goes first."""
    import time

    from peerd_client import connection as module

    order: list[str] = []

    class Slow:  # the retry thread's connection: it is preempted between taking the entry and sending it
        def call_unless_busy(self, op, body):
            time.sleep(0.3)
            order.append(op)

    class Live:  # this process's connection, neither lost nor fresh
        _lost = None

        def notice_loss(self):
            pass

    pending = module.Undelivered()
    pending._retrying = threading.current_thread()  # no retry thread of its own: the test plays it
    monkeypatch.setattr(module, "undelivered", pending)
    monkeypatch.setattr(module, "_connection", Live())
    pending.add("release", {"group": "g", "name": "default", "rank": 0})
    retry = threading.Thread(target=pending.flush, args=(Slow(),))
    retry.start()
    time.sleep(0.05)  # the retry thread took the entry: nothing is queued
    module.connection(starting_over=True)
    order.append("join")
    retry.join()
    assert order == ["release", "join"], order


def test_a_child_forked_during_a_flush_can_flush_its_own():
    """The retry thread's flush held its lock at the fork: the child's first connection waited on it forever."""
    import os

    from peerd_client.connection import Undelivered

    pending = Undelivered()
    holding, done = threading.Event(), threading.Event()

    def flushing() -> None:  # another thread of the parent, inside a flush at the fork
        with pending._flushing:
            holding.set()
            done.wait(10)

    holder = threading.Thread(target=flushing)
    holder.start()
    holding.wait(10)
    child = os.fork()
    if child == 0:
        pending.forget()  # what the fork hook does
        os._exit(0 if pending._flushing.acquire(timeout=2) else 1)
    done.set()
    holder.join()
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_new_daemon_run_with_its_predecessors_pid_retires_only_the_old_runs_chunks(monkeypatch):
    """A daemon restarted in its own pid namespace (PID 1 in a container) has its predecessor's pid: the
    chunks are keyed, and retired, by run (pid, instance), so the new run's chunks are not the old one's."""
    from peerd_client import connection as module

    runs = iter([(1, 0xA), (1, 0xB)])
    retired = []

    class FakeConnection:
        def __init__(self, path):
            self.run = next(runs)
            self.hello = {"pid": self.run[0], "instance": self.run[1]}
            self._lost = None

        def notice_loss(self):
            pass

        def close(self):
            pass

    monkeypatch.setattr(module, "Connection", FakeConnection)
    monkeypatch.setattr(module.mappings, "retire", retired.append)
    monkeypatch.setattr(module, "_connection", None)
    monkeypatch.setattr(module, "_daemon_run", None)
    first = module.connection()
    assert retired == [] and module.connection() is first, "the same run: nothing to retire"
    first._lost = "the daemon restarted"
    module.connection()
    assert retired == [(1, 0xA)], "the old run's chunks alone, though the pid is the same"
