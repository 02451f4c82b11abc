"""The fd channel's two halves in one process: wide sets, refusals, impostors."""

from __future__ import annotations

import os
import threading
import time

import pytest
import zmq

from peerd.fdchannel import FDS_PER_MESSAGE, FdChannelServer, fetch_fds
from peerd.protocol import ErrorCode, ProtocolError


@pytest.fixture
def channel(tmp_path):
    """A channel whose answer is ``answers[rank]`` (or its error), served by a thread like the daemon's loop."""
    answers: dict = {}

    def answer(who, groups, request):
        assert who.pid == os.getpid() and who.uid == os.geteuid()  # the kernel's word, not the request's
        assert groups() == frozenset(os.getgroups()), "its groups, read off its own connection"
        answers.setdefault("asked", []).append(request["rank"])
        if isinstance(answers[request["rank"]], ProtocolError):
            raise answers[request["rank"]]
        return answers[request["rank"]]

    server = FdChannelServer(str(tmp_path / "peerd.sock.fd"), None, answer)
    poller, stop = zmq.Poller(), threading.Event()
    server.attach(poller)

    def loop():
        while not stop.is_set():
            server.serve(dict(poller.poll(50)), time.monotonic())

    thread = threading.Thread(target=loop)
    thread.start()
    yield server.path, answers
    stop.set()
    thread.join()
    server.close()
    assert not os.path.exists(server.path)


def test_a_set_wider_than_one_message_arrives_whole_and_in_rank_order(channel):
    path, answers = channel
    npes = 2 * FDS_PER_MESSAGE + 3  # three messages
    memory = [os.memfd_create("peerd-test") for _ in range(npes)]
    handles = [b"%04d" % r for r in range(npes)]
    answers[0] = (handles, memory)
    try:
        got, fds = fetch_fds(path, {"group": "g", "name": "n", "rank": 0}, 10)
        inodes = [os.fstat(fd).st_ino for fd in fds]
        for fd in fds:
            os.close(fd)
        assert got == handles
        assert inodes == [os.fstat(m).st_ino for m in memory]
    finally:
        for fd in memory:
            os.close(fd)


def test_ranks_sharing_a_chunk_are_sent_its_fd_once(channel, monkeypatch):
    """A passed fd counts against the daemon's user until read: 1024 ranks of one chunk cost one."""
    import socket as sockets

    path, answers = channel
    chunk, other = os.memfd_create("peerd-test"), os.memfd_create("peerd-test")
    npes = 1024
    answers[0] = ([b"c"] * (npes - 1) + [b"o"], [chunk] * (npes - 1) + [other])
    passed = []
    real = sockets.recv_fds
    monkeypatch.setattr(sockets, "recv_fds", lambda *a, **k: passed.append(real(*a, **k)) or passed[-1])
    try:
        got, fds = fetch_fds(path, {"group": "g", "name": "n", "rank": 0}, 10)
        assert sum(len(message[1]) for message in passed) == 2 and len(passed) == 1, "two fds, one message"
        assert len(fds) == npes and len(set(fds)) == 2 and got == answers[0][0]
        assert {os.fstat(fds[0]).st_ino, os.fstat(fds[-1]).st_ino} == {os.fstat(chunk).st_ino, os.fstat(other).st_ino}
        assert os.fstat(fds[0]).st_ino == os.fstat(chunk).st_ino
        for fd in set(fds):
            os.close(fd)
    finally:
        os.close(chunk)
        os.close(other)


def test_memory_from_another_process_than_the_daemon_is_refused(channel):
    path, answers = channel
    answers[0] = ([b"h"], [os.memfd_create("peerd-test")])
    with pytest.raises(ConnectionError, match=f"served by pid {os.getpid()}, not by the daemon"):
        fetch_fds(path, {"group": "g", "name": "n", "rank": 0}, 10, daemon_pid=os.getpid() + 1)
    assert "asked" not in answers, "refused before asking for anything"
    os.close(answers[0][1][0])


def test_a_refusal_carries_the_daemons_code(channel):
    path, answers = channel
    answers[1] = ProtocolError(ErrorCode.NOT_MEMBER, "rank 1 belongs to pid 1")
    with pytest.raises(ProtocolError) as refused:
        fetch_fds(path, {"group": "g", "name": "n", "rank": 1}, 10)
    assert refused.value.code is ErrorCode.NOT_MEMBER and refused.value.message == "rank 1 belongs to pid 1"


def test_a_daemon_past_its_in_flight_fd_limit_says_so(channel, monkeypatch):
    """ETOOMANYREFS (other processes hold too many unread fds of the daemon's user): a coded answer that
    names the cause, not a reply cut short."""
    import errno
    import socket as sockets

    path, answers = channel
    memory = os.memfd_create("peerd-test")
    answers[0] = ([b"h"], [memory])

    def refused(sock, buffers, fds, *rest):
        if fds:
            raise OSError(errno.ETOOMANYREFS, os.strerror(errno.ETOOMANYREFS))
        return sock.sendmsg(buffers)

    monkeypatch.setattr(sockets, "send_fds", refused)
    try:
        with pytest.raises(ProtocolError) as err:
            fetch_fds(path, {"group": "g", "name": "n", "rank": 0}, 10)
        assert err.value.code is ErrorCode.LIMIT_EXCEEDED and "CAP_SYS_RESOURCE" in err.value.message
    finally:
        os.close(memory)
