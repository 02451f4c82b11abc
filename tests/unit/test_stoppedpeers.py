"""peerd_client.stoppedpeers: how long a peer has been stopped, and reading it off a real process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from peerd_client.stoppedpeers import POLL_S, STALE_AFTER_S, StopClock, StoppedPeers, own_pid, peer_pids, stopped


def test_a_pid_counts_from_the_first_poll_that_saw_it_stopped_and_a_running_poll_resets_it():
    clock = StopClock()
    for now in (0.0, 1.0, 2.0):
        clock.poll(now)
    assert clock.seen(7, True, 2.0) == 0.0
    clock.poll(3.0)
    assert clock.seen(7, True, 3.0) == 1.0
    clock.poll(4.0)
    assert clock.seen(7, False, 4.0) == 0.0
    clock.poll(5.0)
    assert clock.seen(7, True, 5.0) == 0.0, "stopped again: counted afresh"


def test_a_gap_between_polls_counts_nothing_the_watcher_did_not_see():
    """The watcher itself was stopped with its whole job (Ctrl-Z): a peer still stopped just after
    the job resumes has not been stopped for the whole gap, as far as anyone watching knows."""
    clock = StopClock()
    clock.poll(0.0)
    clock.seen(7, True, 0.0)
    later = STALE_AFTER_S + 60
    clock.poll(later)
    assert clock.seen(7, True, later) == 0.0
    clock.poll(later + POLL_S)
    assert clock.seen(7, True, later + POLL_S) == POLL_S


def test_pids_no_longer_watched_are_forgotten():
    clock = StopClock()
    clock.poll(0.0)
    clock.seen(7, True, 0.0)
    clock.keep({8})
    clock.poll(1.0)
    assert clock.seen(7, True, 1.0) == 0.0


def test_a_real_process_reads_stopped_only_while_it_is():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not stopped(child.pid)
        child.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not stopped(child.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stopped(child.pid)
        child.send_signal(signal.SIGCONT)
        while stopped(child.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not stopped(child.pid)
    finally:
        child.kill()
        child.wait()
    assert not stopped(child.pid), "a reaped pid is not stopped"
    assert not stopped(os.getpid())


def _wait_for(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_a_process_whose_main_thread_exited_reads_stopped_while_its_other_threads_are():
    """Its /proc/PID/stat (the main thread's) says Z for good: read as running, the peers of such a
    stopped rank spun until their timeout, or for ever in a kernel without a deadline."""
    leader_exits = ("import ctypes, threading, time\n"
                    "threading.Thread(target=lambda: time.sleep(60)).start()\n"
                    "ctypes.CDLL(None).pthread_exit(None)\n")
    child = subprocess.Popen([sys.executable, "-c", leader_exits])
    try:
        def leader_state():
            with open(f"/proc/{child.pid}/stat", "rb") as f:
                return f.read().rsplit(b")", 1)[-1].split()[0]
        assert _wait_for(lambda: leader_state() == b"Z"), "the main thread did not exit"
        assert not stopped(child.pid)
        child.send_signal(signal.SIGSTOP)
        assert _wait_for(lambda: stopped(child.pid))
        child.send_signal(signal.SIGCONT)
        assert _wait_for(lambda: not stopped(child.pid))
    finally:
        child.kill()
        child.wait()


def test_a_member_in_the_daemons_pid_namespace_watches_the_pids_the_daemon_saw():
    me = os.getpid()
    assert peer_pids(1, [11, me, 13], None) == [11, 0, 13]
    assert peer_pids(1, [11, me, 13], [["pid:[9]", 5], None, ["pid:[9]", 6]]) == [11, 0, 13], "claims unused"


def test_a_member_in_another_pid_namespace_watches_the_peers_that_claim_its_own_by_their_own_pids():
    """The daemon's pids name other processes here; the claims made in this namespace name its peers."""
    here = own_pid()
    assert here is not None and here[1] == os.getpid()
    other_ns = ["pid:[1]", 5] if here[0] != "pid:[1]" else ["pid:[2]", 5]
    daemon_saw = [101, 102, 103, 104]
    claims = [[here[0], 40], here, other_ns, None]
    assert peer_pids(1, daemon_saw, claims) == [40, 0, 0, 0]
    assert peer_pids(1, daemon_saw, None) is None, "no claims: nothing known here"
    assert peer_pids(1, daemon_saw, [[here[0], 40], [here[0], here[1] + 1], None, None]) is None, (
        "a reply whose claim for this rank is not this process's own is not about this process")


def test_a_finalizer_discarding_a_link_under_the_watchers_lock_never_waits_on_it():
    """A PeerBuffer dropped in a reference cycle is finalized by whichever thread's allocation starts a
    collection, maybe the watcher snapshotting its links (or watch() starting it) with the lock held;
    its close discards its link there. With the lock taken in discard, the thread waited on itself,
    and every later close() in the process hung."""
    peers, link = StoppedPeers(), object()
    peers._links[link] = [0, 12345]
    done = threading.Event()

    def collected_under_the_lock():
        with peers._lock:
            peers.discard(link)
        done.set()

    threading.Thread(target=collected_under_the_lock, daemon=True).start()
    assert done.wait(10) and link not in peers._links


def test_a_page_whose_slot_a_newer_set_took_is_not_aborted_for_a_peer_of_the_older_one():
    """The watcher read a link's page, then went on after the link closed and the daemon formatted the
    slot for a newer set: it aborted that set, naming a peer of the older one."""
    from types import SimpleNamespace

    from peerd.controlpage import AbortCode
    from tests.pagekit import OwnPage

    with OwnPage(2, 0x1234, generation=7) as page:
        link = SimpleNamespace(page=page, set_id=7, label="group=g name=n rank 0")
        peers = StoppedPeers(grace=1.0)
        page.format(2, 0x1234, 8)  # the set was freed; its slot is set 8's
        peers._check(link, [0, 4242], {4242: 5.0})
        assert page.aborted() is None, "another set's page"
        page.format(2, 0x1234, 7)
        peers._check(link, [0, 4242], {4242: 5.0})
        assert page.aborted().code == AbortCode.MEMBER_STOPPED, "its own page: aborted, naming the peer"
