"""Host memory has no name: only the members of a set can reach it, nothing can
squat it, and a daemon that dies leaves none of it behind (issue 13, items 1, 2, 12).

Real extra Unix users (CI runs as root): a daemon user, and two workers A and
B who share the daemon's socket group.
"""

from __future__ import annotations

import errno
import grp
import json
import os
import pwd
import signal
import socket
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest

from peerd.fdchannel import connect, fetch_fds
from peerd.paths import check_socket_path, fd_socket_path
from peerd.protocol import ErrorCode, ProtocolError
from tests.conftest import Daemon, finish, memfd_holders, memfds, run_ranks, start_rank, local_users, wait_until

GROUP, DAEMON_USER, USER_A, USER_B = "pdm-sock", "pdm-daemon", "pdm-a", "pdm-b"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create users (CI runs as root)")


@pytest.fixture(scope="module")
def users():
    """The daemon's user and workers A and B, all in the socket group: name -> uid:gid:socket gid."""
    names = (DAEMON_USER, USER_A, USER_B)
    with local_users(GROUP, *names):
        gid = grp.getgrnam(GROUP).gr_gid
        yield {name: f"{pwd.getpwnam(name).pw_uid}:{pwd.getpwnam(name).pw_gid}:{gid}" for name in names}


def as_user(spec: str, probe) -> dict:
    """probe() run in a child of this process that became user ``spec`` (uid:gid:gids); its JSON result."""
    uid, gid, gids = spec.split(":")
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            os.close(read)
            os.setgroups([int(g) for g in gids.split(",")])
            os.setgid(int(gid))
            os.setuid(int(uid))
            out = probe()
        except BaseException as err:
            out = {"error": repr(err)}
        os.write(write, json.dumps(out).encode())
        os._exit(0)
    os.close(write)
    data = b""
    while chunk := os.read(read, 65536):
        data += chunk
    os.close(read)
    os.waitpid(child, 0)
    return json.loads(data)


def named_in_shm(daemon_pid: int) -> list[str]:
    """What the old host backend would have named in /dev/shm for this daemon."""
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"peerd-{daemon_pid}-")]


def fetch_code(path: str, slot: dict) -> str:
    """The daemon's answer to an fd request: GIVEN, or its error code."""
    try:
        _, fds = fetch_fds(path, slot, 10)
    except ProtocolError as err:
        return err.code.value
    for fd in set(fds):
        os.close(fd)
    return "GIVEN"


def hold(daemon: Daemon, group: str, *extra: str) -> list[subprocess.Popen]:
    """Two ranks holding a live set of ``group`` until they get a line on stdin."""
    ranks = [start_rank(daemon, "join", r, 2, "--group", group, "--hold", "-1", *extra, stdin=subprocess.PIPE)
             for r in (0, 1)]
    wait_until(lambda: f"group={group} name=default live" in daemon.logs(), 90, f"{group} to go live")
    return ranks


def let_go(ranks: list[subprocess.Popen]) -> list[dict]:
    for p in ranks:
        p.stdin.write("go\n")
        p.stdin.flush()
    return [finish(p) for p in ranks]


def test_a_user_of_the_socket_group_cannot_reach_another_users_buffers(socket_dir, users):
    """The systemd layout: the daemon runs as its own user with --socket-group; A and B are both in it."""
    uid, gid, _ = (int(x) for x in users[DAEMON_USER].split(":"))
    os.chown(socket_dir, uid, gid)
    os.chmod(socket_dir, 0o755)
    d = Daemon(os.path.join(socket_dir, "run", "peerd.sock"), Path(socket_dir) / "daemon.log",
               extra_env={"PEERD_DAEMON_USER": DAEMON_USER})  # the workers trust this daemon's user
    d.proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).parents[1] / "as_user.py"), users[DAEMON_USER], "serve",
         "--backend", "host", "--socket", d.socket, "--socket-group", GROUP],
        stdout=open(d.log, "ab"), stderr=subprocess.STDOUT, env=d.env())
    wait_until(lambda: "serving" in d.logs() or d.proc.poll() is not None, 60, "the daemon to start")
    ranks = []
    try:
        ranks += hold(d, "secret", "--as-user", users[USER_A])
        held = memfds(d.proc.pid)
        assert len(held) == 1, "the daemon holds A's two buffers in one chunk"
        assert named_in_shm(d.proc.pid) == [], "nothing of A's is named in /dev/shm"

        def snoop() -> dict:
            slot = {"group": "secret", "name": "default", "rank": 0}
            opened = []
            for fd in held:
                try:
                    os.close(os.open(f"/proc/{d.proc.pid}/fd/{fd}", os.O_RDONLY))
                    opened.append("OPENED")
                except OSError as err:
                    opened.append(errno.errorcode[err.errno])
            return {"shm": named_in_shm(d.proc.pid), "fetch": fetch_code(fd_socket_path(d.socket), slot),
                    "proc_fd": opened}

        seen = as_user(users[USER_B], snoop)
        assert seen["shm"] == [], seen
        # NOT_MEMBER: the rank is another pid's (NOT_FOUND where each uid has its own key namespace)
        assert seen["fetch"] in ("NOT_MEMBER", "NOT_FOUND"), seen
        assert seen["proc_fd"] == ["EACCES"], seen
        assert all(r["ok"] for r in let_go(ranks))
        assert d.settled_segments() == []
    finally:
        for p in ranks:  # a failed assertion must not leave A's processes behind (userdel refuses then)
            p.kill()
            p.wait()
        assert d.stop() == 0, d.logs()


def test_names_squatted_in_dev_shm_block_no_join(daemon, users):
    pid = daemon.proc.pid

    def squat() -> dict:
        for n in range(3000):  # every name the old backend would have tried
            os.close(os.open(f"/dev/shm/peerd-{pid}-{n}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
        return {"squatted": len(named_in_shm(pid))}

    try:
        assert as_user(users[USER_B], squat) == {"squatted": 3000}
        results = run_ranks(daemon, "exchange", 2, "--group", "squatted")
        assert all(r["ok"] for r in results), results
    finally:
        for name in named_in_shm(pid):
            os.unlink(os.path.join("/dev/shm", name))


def start_on_pid(daemon: Daemon, pid: int) -> bool:
    """Start the daemon again, on ``pid`` where the kernel gives it (others fork too: best effort)."""
    for _ in range(3):
        try:
            Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
        except OSError:
            pass
        daemon.start()
        if daemon.proc.pid == pid:
            return True
        assert daemon.stop() == 0
    daemon.start()
    return False


def test_a_killed_daemon_leaves_no_memory_and_a_restart_even_on_its_pid_starts_clean(daemon):
    ranks = hold(daemon, "crash")
    lone = start_rank(daemon, "join", 0, 2, "--group", "half", "--timeout", "120")  # a set still in rendezvous
    wait_until(lambda: "group=half name=default rank=0" in daemon.logs(), 90, "rank 0 of half to join")
    old_pid = daemon.proc.pid
    held = set(daemon.segments())
    assert len(held) == 1, "the three buffers of one uid share one chunk"
    daemon.proc.kill()
    daemon.proc.wait()
    assert [r["ok"] for r in let_go(ranks)] == [True, True], "closing after the daemon died is quiet"
    assert finish(lone)["type"] == "DaemonUnavailable"
    assert named_in_shm(old_pid) == [], "nothing named is left"
    assert memfd_holders(held) == [], "no process holds the dead daemon's memory"
    assert os.path.exists(fd_socket_path(daemon.socket)), "a SIGKILLed daemon leaves its fd channel's socket"

    start_on_pid(daemon, old_pid)  # whether or not it got the pid: nothing is keyed on it
    assert daemon.settled_segments() == [] and json.loads(daemon.cli("ls", "--json").stdout) == []
    assert named_in_shm(old_pid) == []
    assert all(r["ok"] for r in run_ranks(daemon, "exchange", 2, "--group", "after-crash"))


def test_the_fd_channel_gives_a_sets_memory_to_the_pids_holding_its_ranks_only(daemon):
    ranks = hold(daemon, "mine")
    path = fd_socket_path(daemon.socket)
    mine_before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(ProtocolError) as other_pid:  # this test: the ranks' uid, another pid
        fetch_fds(path, {"group": "mine", "name": "default", "rank": 0}, 10)
    assert other_pid.value.code is ErrorCode.NOT_MEMBER
    assert f"belongs to pid {ranks[0].pid}" in other_pid.value.message
    assert fetch_code(path, {"group": "nobody", "name": "default", "rank": 0}) == "NOT_FOUND"
    assert fetch_code(path, {"group": "mine", "rank": 0}) == "BAD_REQUEST"
    assert len(os.listdir("/proc/self/fd")) == mine_before, "no fd came with a refusal"
    assert all(r["ok"] for r in let_go(ranks))


def test_members_map_each_others_memory_from_the_fds_and_cannot_resize_them(daemon):
    exchanged = run_ranks(daemon, "exchange", 2, "--group", "fds")
    for r in exchanged:
        assert r["ok"] and r["zero"] and r["seen"] == [[1, 1], [2, 2]], r
    for r in run_ranks(daemon, "sealed", 2, "--group", "sealed"):
        assert r["ok"] and r["same_handles"] and r["size_kept"], r
        assert (r["shrink"], r["grow"], r["seal_writes"]) == ("EPERM", "EPERM", "EPERM"), r


def closed(sock: socket.socket) -> bool:
    """Whether the daemon closed this connection without a (further) answer."""
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:  # it closed with our request unread
        return True


def test_the_fd_channel_drops_oversized_idle_and_excess_connections_and_serves_on(daemon):
    path = fd_socket_path(daemon.socket)
    oversized = connect(path, 30)
    oversized.send(b"\x80" * 5000)
    assert closed(oversized), "an oversized request is dropped unanswered"
    idle = [connect(path, 30) for _ in range(80)]  # past the cap: the oldest go at once, the rest in time
    for sock in idle:
        assert closed(sock), "an idle connection is dropped"
        sock.close()
    oversized.close()
    chatty, planted = connect(path, 30), os.memfd_create("peerd")
    request = msgpack.packb({"group": "nobody", "name": "default", "rank": 0})
    socket.send_fds(chatty, [request], [planted])  # an fd offered to the daemon
    assert msgpack.unpackb(chatty.recv(65536))["code"] == "NOT_FOUND"
    try:
        chatty.send(request)  # a second request on the same connection
    except (ConnectionResetError, BrokenPipeError):  # closed already
        pass
    assert closed(chatty), "one answer per connection, then it is closed"
    chatty.close()
    os.close(planted)
    assert daemon.settled_segments() == [], "the daemon kept no fd a client sent it"
    assert fetch_code(path, {"group": "nobody", "name": "default", "rank": 0}) == "NOT_FOUND"
    assert daemon.cli("status").returncode == 0


def test_a_flood_of_idle_fd_channel_connections_pushes_out_only_the_flooders_own(socket_dir, users):
    """Another user in the socket group opens connections and sends nothing: past its share of 16 its
    own oldest go, so a member's connection accepted before the flood is still answered."""
    os.chmod(socket_dir, 0o755)
    d = Daemon(os.path.join(socket_dir, "run", "peerd.sock"), Path(socket_dir) / "daemon.log",
               args=("--socket-group", GROUP)).start()
    try:
        path = fd_socket_path(d.socket)
        member = connect(path, 30)  # accepted first (the backlog is in order), its request still to come

        def flood() -> dict:
            import select
            import time

            socks = [connect(path, 30) for _ in range(100)]
            dropped, until = set(), time.monotonic() + 0.5  # well inside the member's 1 s to send
            while len(dropped) < 100 - 16 and time.monotonic() < until:
                for sock in select.select([s for s in socks if s not in dropped], [], [], 0.05)[0]:
                    dropped.add(sock)  # readable with nothing sent: closed by the daemon
            return {"dropped": len(dropped)}

        flooded = as_user(users[USER_A], flood)
        assert flooded.get("dropped") == 100 - 16, ("all but its share of 16 pushed out, none timed out yet", flooded)
        member.send(msgpack.packb({"group": "nobody", "name": "default", "rank": 0}))
        assert msgpack.unpackb(member.recv(65536))["code"] == "NOT_FOUND", "answered, not pushed out"
        member.close()
        assert d.cli("status").returncode == 0
    finally:
        assert d.stop() == 0, d.logs()


def test_a_socket_path_leaves_room_for_the_fd_channel_beside_it():
    assert check_socket_path("/" + "s" * 103) == "/" + "s" * 103
    with pytest.raises(ValueError, match="longer than 104 bytes"):
        check_socket_path("/" + "s" * 104)


def _dealer(path: str):
    import zmq

    from peerd.routingids import new_routing_id

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, new_routing_id())
    sock.connect(f"ipc://{path}")
    return sock


def _ask(sock, op: str, body: dict, request_id: int = 1):
    """One raw request on ``sock`` and its decoded reply."""
    from peerd import protocol

    sock.send(protocol.encode_request(request_id, op, body))
    assert sock.poll(60_000), f"{op} was never answered"
    return protocol.decode_reply(sock.recv())


def _join_one(group: str, nbytes: int) -> dict:
    return {"group": group, "name": "default", "rank": 0, "npes": 1, "nbytes": nbytes, "device": "host", "flags": 0,
            "timeout": 60}


def test_a_huge_buffer_reserved_off_the_loop_holds_up_no_other_set_and_is_freed_off_it_too(daemon):
    """Reserving (and freeing) a big buffer's pages takes the kernel about 0.25 s per GiB: on the
    daemon's loop it stalled every other user's setup. Now, while a 1 GiB set waits for its memory
    (every rank joined), the daemon answers, and a small set made meanwhile opens first; both end
    with every memfd closed."""
    from peerd import protocol

    huge, small, look = (_dealer(daemon.socket) for _ in range(3))
    huge.send(protocol.encode_request(1, "join", _join_one("huge", 1 << 30)))
    seen = {}
    wait_until(lambda: seen.update(g=[g for g in _ask(look, "ls", {}).body["groups"] if g["group"] == "huge"])
               or seen["g"], 30, "the daemon to read the huge join")
    assert seen["g"][0]["state"] == "joining" and seen["g"][0]["joined"] == [0], \
        ("every rank in, its memory still being reserved, and the daemon answering", seen)
    opened = _ask(small, "join", _join_one("small", 4096))
    assert opened.ok and opened.body["sizes"] == [4096], opened
    assert not huge.poll(0), "the small set opened while the 1 GiB one still waited for its memory"
    assert huge.poll(60_000), "the huge join was never answered"
    reply = protocol.decode_reply(huge.recv())
    assert reply.ok and reply.body["sizes"] == [1 << 30], reply
    for sock, group, joined in ((huge, "huge", reply), (small, "small", opened)):
        released = _ask(sock, "release", {"group": group, "name": "default", "rank": 0, "set": joined.body["set"]}, 2)
        assert released.ok, released
    for sock in (huge, small, look):
        sock.close()
    wait_until(lambda: daemon.segments() == [], 30, "the daemon to close both memfds")


def test_a_buffer_past_the_memory_the_machine_has_available_is_refused_before_any_is_taken(socket_dir):
    """Reserving past MemAvailable would have the kernel swap and call the OOM killer on some process:
    the join is refused with the numbers instead, and the daemon serves on."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    d = Daemon(os.path.join(socket_dir, "peerd.sock"), Path(socket_dir) / "daemon.log",
               args=("--max-buffer-bytes", f"{2 * total}")).start()
    try:
        sock = _dealer(d.socket)
        refused = _ask(sock, "join", _join_one("greedy", 2 * total))
        assert not refused.ok and refused.error.code is ErrorCode.ALLOCATION_FAILED, refused
        assert f"cannot reserve {2 * total} bytes" in refused.error.message and "available" in refused.error.message
        fine = _ask(sock, "join", _join_one("modest", 4096), 2)
        assert fine.ok, fine
        assert _ask(sock, "release", {"group": "modest", "name": "default", "rank": 0, "set": fine.body["set"]}, 3).ok
        sock.close()
        wait_until(lambda: d.segments() == [], 10, "the modest buffer's memfd to close")
    finally:
        assert d.stop() == 0, d.logs()


@pytest.mark.parametrize("idle_s", ["0", "30"], ids=["chunks-freed-when-empty", "chunks-kept"])
def test_a_daemon_that_stops_leaves_the_memory_of_live_workers_as_it_is(socket_dir, idle_s):
    """Freed chunks are punched out before they close, so a member that kept a memfd keeps none of the
    daemon's memory; at shutdown that zeroed every live worker's buffer under it. A stopping daemon now
    leaves freed memory as it is (the kernel frees it with its last holder)."""
    d = Daemon(os.path.join(socket_dir, "peerd.sock"), Path(socket_dir) / "daemon.log",
               extra_env={"PEERD_ARENA_IDLE_S": idle_s}).start()
    rank = start_rank(d, "kept", 0, 1, "--group", "kept", "--nbytes", str(1 << 20), stdin=subprocess.PIPE)
    assert rank.stdout.readline().strip() == "READY"
    d.proc.send_signal(signal.SIGTERM)  # draining
    wait_until(lambda: "draining" in d.logs(), 10, "the daemon to start draining")
    assert d.stop() == 0, d.logs()[-3000:]  # again: it stops at once, the set still held
    rank.stdin.write("\n")
    rank.stdin.flush()
    assert finish(rank, 30).get("kept") is True


def test_a_worker_lets_go_of_the_host_chunks_the_daemon_gave_back(daemon):
    """The test daemon gives an emptied chunk back at once, under the worker's mapping (its pages punched):
    the worker kept every one mapped, a chunk of address space and a mapping more per cycle, for life."""
    (result,) = run_ranks(daemon, "given_back", 1, "--group", "cycles")
    assert result["ok"] and result["mapped"] == 1 and result["chunk_mappings"] == 1, result
