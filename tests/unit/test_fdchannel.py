"""The fd channel's two halves in one process: wide sets, refusals, impostors."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest
import zmq

from peerd.fdchannel import FDS_PER_MESSAGE, FdChannelServer, FdRequest, fetch_fds
from peerd.fdroom import FdRoom
from peerd.protocol import ErrorCode, ProtocolError
from peerd.tally import Tally


@pytest.fixture
def room():
    """The daemon's fd room, as the channel shares it: no limit unless a test sets its size."""
    return FdRoom()


@pytest.fixture
def channel(tmp_path, room):
    """A channel whose answer is ``answers[rank]`` (or its error), served by a thread like the daemon's loop."""
    answers: dict = {}

    def answer(who, groups, request):
        assert who.pid == os.getpid() and who.uid == os.geteuid()  # the kernel's word, not the request's
        assert groups() == frozenset(os.getgroups()), "its groups, read off its own connection"
        answers.setdefault("asked", []).append(request["rank"])
        if isinstance(answers[request["rank"]], ProtocolError):
            raise answers[request["rank"]]
        return answers[request["rank"]]

    server = FdChannelServer(str(tmp_path / "peerd.sock.fd"), None, answer, room,
                             Tally(logging.getLogger("test"), "dropped %d"))
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
    assert room.used == 0, "every connection gave its place in the fd room back"


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


def test_a_request_sent_now_is_answered_meanwhile_and_read_later_or_dropped_unread(channel):
    """A worker sends its page area's request before opening its chunks and reads the answer after
    (FdRequest): the daemon answers while the worker waits on the GPU. A request dropped unread (its
    set failed first) takes its fds with it: nothing stays open here, and the uid's unread replies
    are not left counting against it (the channel fixture checks the fd room is empty at the end)."""
    path, answers = channel
    memory = os.memfd_create("peerd-test")
    answers[0] = ([b"area", b"alive"], [memory, memory])
    slot = {"group": "g", "name": "n", "rank": 0}
    try:
        open_before = set(os.listdir("/proc/self/fd"))
        request = FdRequest(path, slot, 10)
        deadline = time.monotonic() + 10
        while answers.get("asked") != [0]:  # answered with no one reading yet
            assert time.monotonic() < deadline, "the channel never read the request"
            time.sleep(0.01)
        handles, fds = request.reply()
        assert handles == [b"area", b"alive"] and len(fds) == 2 and fds[0] == fds[1]
        assert os.fstat(fds[0]).st_ino == os.fstat(memory).st_ino, "the daemon's memory itself"
        os.close(fds[0])
        for _ in range(3):
            with FdRequest(path, slot, 10):
                time.sleep(0.05)  # answered, never read
        time.sleep(0.2)
        assert set(os.listdir("/proc/self/fd")) == open_before, "no socket or fd of an unread reply is left"
        _, fds = fetch_fds(path, slot, 10)  # the uid is served as before
        os.close(fds[0])
    finally:
        os.close(memory)


def test_memory_from_another_process_than_the_daemon_is_refused(channel):
    path, answers = channel
    answers[0] = ([b"h"], [os.memfd_create("peerd-test")])
    with pytest.raises(ConnectionError, match=f"served by pid {os.getpid()}, not by the daemon"):
        fetch_fds(path, {"group": "g", "name": "n", "rank": 0}, 10, daemon_pid=os.getpid() + 1)
    assert "asked" not in answers, "refused before asking for anything"
    os.close(answers[0][1][0])


def test_memory_from_another_user_than_the_daemons_is_refused_where_no_pid_can_be_compared(channel):
    """A worker in a pod sees pid 0 for any server outside its pid namespace, so the pid check passed whoever
    served the channel's path; the server's uid must be the daemon's, as for the daemon's own socket (no
    pid is compared here, as none can be there)."""
    path, answers = channel
    answers[0] = ([b"h"], [os.memfd_create("peerd-test")])
    daemons = os.geteuid() + 1
    with pytest.raises(ConnectionError, match=rf"served by uid {os.geteuid()}\b.*not by the daemon's user \(uid "
                                              rf"{daemons}\b"):
        fetch_fds(path, {"group": "g", "name": "n", "rank": 0}, 10, daemon_uid=daemons)
    assert "asked" not in answers, "refused before asking for anything"
    handles, fds = fetch_fds(path, {"group": "g", "name": "n", "rank": 0}, 10, daemon_uid=os.geteuid())
    assert handles == [b"h"] and len(fds) == 1, "the daemon's own user is served"
    os.close(fds[0])
    os.close(answers[0][1][0])


def test_a_request_whose_connection_was_dropped_for_newer_ones_asks_again(channel, monkeypatch):
    """A worker descheduled between its connect and its request finds its connection the uid's oldest
    unanswered one when MAX_CONNECTIONS_PER_UID newer ones come: the channel drops it unread, and the
    worker asks again on a new connection (its setup failed: 'Broken pipe')."""
    import socket

    import peerd.fdchannel as fdchannel

    path, answers = channel
    answers[0] = ([b"h"], [os.memfd_create("peerd-test")])
    newer: list[socket.socket] = []
    real_send = fdchannel.FdRequest._send

    def crowded(self):
        if newer:
            return real_send(self)
        sock = fdchannel.connect(path, 5)
        time.sleep(0.2)  # accepted, nothing to read yet
        for _ in range(fdchannel.MAX_CONNECTIONS_PER_UID):
            newer.append(fdchannel.connect(path, 5))
        time.sleep(0.2)  # they are accepted, and the first is dropped for them
        sock.send(b"too late")  # raises: the request never goes out on it
        return sock

    monkeypatch.setattr(fdchannel.FdRequest, "_send", crowded)
    try:
        handles, fds = fetch_fds(path, {"group": "g", "name": "n", "rank": 0}, 10)
    finally:
        for sock in newer:
            sock.close()
    assert handles == [b"h"] and len(fds) == 1 and answers["asked"] == [0], answers
    os.close(fds[0])
    os.close(answers[0][1][0])


def test_a_request_read_by_nobody_before_its_connection_closed_asks_again(channel, monkeypatch):
    """The same drop after the request went out (it waited in the connection unread): the worker reads
    the hang-up, not a reply, and asks again."""
    from peerd.fdchannel import FdChannelServer

    path, answers = channel
    answers[0] = ([b"h"], [os.memfd_create("peerd-test")])
    real_respond, dropped = FdChannelServer._respond, []

    def drop_the_first(self, fd, now):
        if dropped:
            return real_respond(self, fd, now)
        dropped.append(fd)
        self._drop(fd)

    monkeypatch.setattr(FdChannelServer, "_respond", drop_the_first)
    handles, fds = fetch_fds(path, {"group": "g", "name": "n", "rank": 0}, 10)
    assert handles == [b"h"] and len(fds) == 1 and len(dropped) == 1 and answers["asked"] == [0], answers
    os.close(fds[0])
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


def test_a_uid_that_never_reads_its_replies_holds_at_most_its_share_of_them(channel):
    """A reply's fds count against the daemon's user until they are read, whatever becomes of the daemon's
    end: a client that asked over and over and never read made the kernel refuse every other user's pass
    (ETOOMANYREFS). An answered connection now counts against its uid until its client reads or closes, and
    a uid holding its share of unread replies is refused more, with no fd. A burst of ordinary requests, each
    read at once, is never refused."""
    import concurrent.futures
    import select
    import socket as sockets

    import msgpack

    from peerd.fdchannel import MAX_UNREAD_PER_UID, UNREAD_CHECK_S, connect

    path, answers = channel
    memory = os.memfd_create("peerd-test")
    answers[0] = ([b"h"], [memory])
    slot = {"group": "g", "name": "n", "rank": 0}

    def ask_and_leave_unread() -> sockets.socket:
        sock = connect(path, 10)
        sock.send(msgpack.packb(slot))
        assert select.select([sock], [], [], 10)[0], "answered"
        assert msgpack.unpackb(sock.recv(1 << 16, sockets.MSG_PEEK))["ok"], "its fds are in flight, unread"
        return sock

    def served() -> bool:
        try:
            _, fds = fetch_fds(path, slot, 10)
        except ProtocolError as err:
            assert err.code is ErrorCode.LIMIT_EXCEEDED, err
            assert f"has {MAX_UNREAD_PER_UID} fd channel replies it has not read" in err.message, err
            return False
        finally:
            time.sleep(0.2)  # the channel sees this connection close
        for fd in fds:
            os.close(fd)
        return True

    try:
        unread = [ask_and_leave_unread() for _ in range(MAX_UNREAD_PER_UID - 1)]
        unread[-1].shutdown(sockets.SHUT_RDWR)  # its queue, fds and all, stays: still unread
        unread[-2].shutdown(sockets.SHUT_WR)  # at EOF, unread: polled no more, still counted
        unread.append(ask_and_leave_unread())
        time.sleep(2 * UNREAD_CHECK_S)  # looked at since: still unread
        assert not served(), "one reply more would put more fds in flight"
        _, fds, _, _ = sockets.recv_fds(unread[0], 1 << 16, 8)  # read, the socket kept open: its place comes back
        for fd in fds:
            os.close(fd)
        time.sleep(2 * UNREAD_CHECK_S)
        assert served()
        unread.append(ask_and_leave_unread())  # its share held again
        assert not served()
        unread.pop(1).close()  # closed unread: its fds leave flight with it
        time.sleep(0.2)
        assert served()
        for sock in unread:
            sock.close()
        time.sleep(0.2)
        with concurrent.futures.ThreadPoolExecutor(2 * MAX_UNREAD_PER_UID) as pool:  # ranks asking at once
            assert all(pool.map(lambda _: served(), range(2 * MAX_UNREAD_PER_UID)))
    finally:
        os.close(memory)


def test_replies_left_unread_take_places_in_the_daemons_fd_room_up_to_their_share(channel, room):
    """Each uid may leave MAX_UNREAD_PER_UID replies unread, each holding the daemon's end of its connection
    open: many users of the socket group together could spend the fds the daemon's connections need. An
    unread reply takes a place in the fd room, unread replies together at most their share of it, and a
    request past that is refused with no fd. A room nearly full of other fds (chunks, pidfds) still serves
    a client that reads its reply at once: the members of a set whose chunk it just admitted."""
    import select

    import msgpack

    from peerd.fdchannel import UNREAD_FD_SHARE, connect

    room.size = 16
    share = int(room.size * UNREAD_FD_SHARE)
    path, answers = channel
    memory = os.memfd_create("peerd-test")
    answers[0] = ([b"h"], [memory])
    slot = {"group": "g", "name": "n", "rank": 0}
    unread, others = [], room.size - 1
    try:
        for _ in range(others):  # the room's other fds, to its last place
            assert room.take()
        _, fds = fetch_fds(path, slot, 10)
        for fd in fds:
            os.close(fd)
        for _ in range(others):
            room.give()
        deadline = time.monotonic() + 10  # the read reply's connection goes at the server's next look
        while room.used and time.monotonic() < deadline:
            time.sleep(0.01)
        assert room.used == 0, "a reply read and closed holds no place"
        for _ in range(share):
            sock = connect(path, 10)
            sock.send(msgpack.packb(slot))
            assert select.select([sock], [], [], 10)[0], "answered"
            unread.append(sock)
        time.sleep(0.2)
        assert room.used == share, "each unread reply holds a place"
        with pytest.raises(ProtocolError) as refused:
            fetch_fds(path, slot, 10)
        assert refused.value.code is ErrorCode.LIMIT_EXCEEDED and "still unread" in refused.value.message
        assert "LimitNOFILE" in refused.value.message, "what the operator can do"
        unread.pop().close()  # its reply purged unread: the place comes back
        time.sleep(0.2)
        _, fds = fetch_fds(path, slot, 10)
        for fd in fds:
            os.close(fd)
    finally:
        for sock in unread:
            sock.close()
        time.sleep(0.2)
        os.close(memory)
