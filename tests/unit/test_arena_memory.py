"""ArenaMemory: the registry's allocate and free over a backend's chunks, and the thread that returns idle ones."""

import errno
import mmap
import os
import random
import select
import threading
import time

import pytest

from peerd.backends import AllocationFailed, ChunkMemory, host, hostreserve
from peerd.arena import OverCap
from peerd.backends.arenas import ArenaMemory, ArenaSettings
from peerd.fdroom import FdRoom
from peerd.punch import punch_out
from peerd.sizes import human


class Chunks(ChunkMemory):
    name = "fake"

    def __init__(self):
        self.live, self.zeroed, self.closed = set(), [], False

    def devices(self):
        return [{"uuid": "gpu0"}, {"uuid": "gpu1"}]

    def allocate_chunk(self, nbytes, device, flags, uid=None):
        token = len(self.live) + len(self.zeroed) + 100
        self.live.add(token)
        return b"handle%d" % token, token

    def zero(self, token, offset, nbytes):
        self.zeroed.append((token, offset, nbytes))

    def free_chunk(self, token):
        self.live.remove(token)

    def chunk_fd(self, token):
        return token

    def close(self):
        self.closed = True


def test_buffers_go_out_as_chunk_handle_offset_and_span():
    chunks = Chunks()
    memory = ArenaMemory(chunks, ArenaSettings(chunk_bytes=1 << 20, idle_s=60))
    a = memory.allocate(100, "gpu0", 0, 1000)
    b = memory.allocate(5000, "gpu0", 0, 1000)
    assert (a.handle, a.offset, a.size, a.span) == (b.handle, 0, 4096, 1 << 20)
    assert (b.offset, b.size) == (4096, 8192) and memory.fd(b) == memory.fd(a)
    (gpu0, gpu1) = memory.devices()
    assert gpu0["arenas"] == [{"uid": 1000, "chunks": 1, "reserved_bytes": 1 << 20, "handed_out_bytes": 12288}]
    assert gpu1["arenas"] == []
    memory.free(a)
    assert chunks.zeroed == [(a.token.chunk.token, 0, 4096)]
    memory.free(b)
    memory.close()
    assert chunks.live == set() and chunks.closed, "shutdown gives every empty chunk back"


def test_the_sweeper_gives_an_idle_chunk_back_by_itself():
    chunks = Chunks()
    memory = ArenaMemory(chunks, ArenaSettings(chunk_bytes=1 << 20, idle_s=0.05))
    memory.free(memory.allocate(100, "gpu0", 0, 1000))
    deadline = time.monotonic() + 10
    while chunks.live and time.monotonic() < deadline:
        time.sleep(0.01)
    assert chunks.live == set() and memory.usage() == []
    memory.close()


class HeldKernel:
    """posix_fallocate as the reservation threads see it: each call waits for a permit (``allow``), then
    is recorded."""

    def __init__(self, monkeypatch, fail_fd_size: int | None = None):
        self.calls: list[tuple[int, int, int]] = []  # (chunk size, offset, bytes)
        self._permits = threading.Semaphore(0)
        self.fail_fd_size = fail_fd_size  # every call for a chunk of this size fails (ENOSPC)
        real = os.posix_fallocate

        def fallocate(fd, offset, nbytes):
            assert self._permits.acquire(timeout=10), "no permit came"
            size = os.fstat(fd).st_size
            self.calls.append((size, offset, nbytes))
            if size == self.fail_fd_size:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            real(fd, offset, nbytes)

        monkeypatch.setattr(hostreserve.os, "posix_fallocate", fallocate)

    def allow(self, calls: int = 1000) -> None:
        for _ in range(calls):
            self._permits.release()


def wait_for(what, seconds: float = 10) -> None:
    until = time.monotonic() + seconds
    while not what():
        assert time.monotonic() < until, "timed out"
        time.sleep(0.005)


@pytest.fixture
def stepped(monkeypatch):
    """(a HeldKernel, a host Memory) with one reservation thread and 1 MiB steps: the order is the kernel's calls."""
    monkeypatch.setattr(hostreserve, "THREADS", 1)
    monkeypatch.setattr(hostreserve, "STEP_BYTES", 1 << 20)
    kernel = HeldKernel(monkeypatch)
    memory = host.Memory()
    yield kernel, memory
    kernel.allow()
    memory.close()


def test_host_chunks_are_reserved_off_the_caller_and_a_failed_reservation_says_why(monkeypatch):
    """posix_fallocate of a big chunk takes seconds: the host backend runs it on its threads, wakes
    ``ready_fd`` once each chunk is done, ``woken`` names it, and ``ready`` then says yes, or raises the
    reason."""
    kernel = HeldKernel(monkeypatch, fail_fd_size=3 << 20)
    memory = host.Memory()
    try:
        fine_handle, fine = memory.allocate_chunk(2 << 20, host.DEVICE, 0)
        short_handle, short = memory.allocate_chunk(3 << 20, host.DEVICE, 0)
        assert not memory.ready(fine) and not memory.ready(short), "allocate_chunk returned before the reservation"
        assert not select.select([memory.ready_fd], [], [], 0)[0], "nothing to wake the loop for yet"
        kernel.allow()
        woken, until = [], time.monotonic() + 10
        while len(woken) < 2 and select.select([memory.ready_fd], [], [], until - time.monotonic())[0]:
            woken += memory.woken()
        assert sorted(woken) == sorted([fine_handle, short_handle]), "each chunk named once its reservation ended"
        assert not select.select([memory.ready_fd], [], [], 0)[0] and memory.woken() == [], "and only once"
        assert memory.ready(fine) and os.fstat(fine.fd).st_blocks * 512 >= 2 << 20, "its pages are really there"
        with pytest.raises(AllocationFailed, match="cannot reserve 3145728 bytes of shared memory: .*No space left"):
            memory.ready(short)
        for token in (fine, short):
            memory.free_chunk(token)
    finally:
        kernel.allow()
        memory.close()


def test_uids_take_turns_and_a_chunk_freed_while_reserved_stops_at_its_next_step(stepped):
    """One uid's huge chunk does not hold up another's small one (a step each, in turn), and a chunk
    freed while still being reserved takes no further step: nothing reserved that nobody is charged for."""
    kernel, memory = stepped
    _, huge = memory.allocate_chunk(8 << 20, host.DEVICE, 0, uid=1000)
    _, small = memory.allocate_chunk(1 << 20, host.DEVICE, 0, uid=2000)
    _, freed = memory.allocate_chunk(6 << 20, host.DEVICE, 0, uid=1000)
    assert memory._reserver.pending == 15 << 20
    kernel.allow(2)
    wait_for(lambda: memory.ready(small))
    assert [size for size, _, _ in kernel.calls] == [8 << 20, 1 << 20], "the small one's turn came second"
    kernel.allow(2)
    wait_for(lambda: len(kernel.calls) == 4)
    assert [size for size, _, _ in kernel.calls[2:]] == [6 << 20, 8 << 20], "uid 1000's chunks in turn"
    memory.free_chunk(freed)
    kernel.allow()
    wait_for(lambda: memory.ready(huge))
    assert sum(1 for size, _, _ in kernel.calls if size == 6 << 20) <= 2, "it stopped at its next step"
    assert [offset for size, offset, _ in kernel.calls if size == 8 << 20] == [n << 20 for n in range(8)]
    assert memory._reserver.pending == 0
    for token in (huge, small):
        memory.free_chunk(token)


def test_a_freed_range_is_zeroed_off_the_caller_in_its_uids_turn_and_reads_ready_once_done(stepped):
    """Punching a freed range's pages out and reserving them again costs as much as a reservation: it
    runs on the threads, in its uid's turn, and ``ready`` says no for that range (not for others) until
    it is done; the loop is woken after each step, told which chunk. Then the range reads zero, pages there, the rest of the chunk untouched.
    Only the bytes a step has punched out count as pending: the rest are still in use."""
    kernel, memory = stepped
    handle, chunk = memory.allocate_chunk(4 << 20, host.DEVICE, 0, uid=1000)
    kernel.allow(4)
    wait_for(lambda: memory.ready(chunk))
    assert memory.woken() == [handle], "reserved"
    with mmap.mmap(chunk.fd, 4 << 20) as view:
        view[:] = b"\xff" * (4 << 20)
        memory.zero(chunk, 1 << 20, 1 << 20)
        memory.zero(chunk, 2 << 20, 1 << 20)  # its neighbour: one range to zero
        other_handle, other = memory.allocate_chunk(1 << 20, host.DEVICE, 0, uid=2000)
        wait_for(lambda: chunk.stepping)
        assert memory._reserver.pending == (1 << 20) + (1 << 20), "the other chunk, and the step punched out"
        assert not memory.ready(chunk, (1 << 20, 4096)) and not memory.ready(chunk, ((3 << 20) - 4096, 4096))
        assert memory.ready(chunk, (0, 1 << 20)) and memory.ready(chunk, (3 << 20, 1 << 20)), "only that range"
        kernel.allow(1)
        wait_for(lambda: memory.ready(chunk, (1 << 20, 1 << 20)))
        assert select.select([memory.ready_fd], [], [], 0)[0], "woken after the step: a set waiting for it may open"
        assert memory.woken() == [handle], "told which chunk"
        kernel.allow(2)
        wait_for(lambda: memory.ready(chunk, (1 << 20, 2 << 20)))
        wait_for(lambda: memory.ready(other))
        assert select.select([memory.ready_fd], [], [], 0)[0], "the loop is woken once the zeroing is done"
        assert sorted(memory.woken()) == sorted([other_handle, handle]), "told which: the other one reserved, this one zeroed"
        assert [(size, offset) for size, offset, _ in kernel.calls[4:]] == [
            (4 << 20, 1 << 20), (1 << 20, 0), (4 << 20, 2 << 20)], "a step each, the uids in turn"
        assert view[1 << 20:3 << 20] == bytes(2 << 20)
        assert view[:1 << 20] + view[3 << 20:] == b"\xff" * (2 << 20), "only the freed range was zeroed"
    assert os.fstat(chunk.fd).st_blocks * 512 >= 4 << 20, "its pages are reserved again"
    assert memory._reserver.pending == 0 and memory.ready(other)
    for token in (chunk, other):
        memory.free_chunk(token)


def test_a_range_that_cannot_be_reserved_again_fails_the_set_asking_and_is_tried_again(stepped):
    """A range whose pages could not be had again raises for the set handed it (memory was short; the rest
    of the chunk serves on), and from then on it is zeroed once more: the next set handed it waits for
    that try, not failing at once. A chunk freed while zeroing stops at its step."""
    kernel, memory = stepped
    _, chunk = memory.allocate_chunk(2 << 20, host.DEVICE, 0)
    _, freed = memory.allocate_chunk(3 << 20, host.DEVICE, 0)
    kernel.allow(5)
    wait_for(lambda: memory.ready(chunk) and memory.ready(freed))
    kernel.fail_fd_size = 2 << 20
    memory.zero(chunk, 0, 1 << 20)
    kernel.allow(1)
    wait_for(lambda: not chunk.zeroing.total)
    with pytest.raises(AllocationFailed, match="cannot zero a freed range of shared memory: .*No space left"):
        memory.ready(chunk, (0, 4096))
    assert memory.ready(chunk) and memory.ready(chunk, (1 << 20, 1 << 20)), "the chunk and its other range serve on"
    assert not memory.ready(chunk, (8192, 4096)), "the failed range is being zeroed again: the next set waits"
    kernel.fail_fd_size = None
    kernel.allow(1)
    wait_for(lambda: memory.ready(chunk, (0, 1 << 20)))
    memory.zero(freed, 0, 3 << 20)
    wait_for(lambda: freed.stepping)
    memory.free_chunk(freed)
    kernel.allow(5)
    wait_for(lambda: not freed.stepping)
    assert sum(1 for size, _, _ in kernel.calls if size == 3 << 20) == 3 + 1, "it stopped after its step"
    assert memory._reserver.pending == 0
    memory.free_chunk(chunk)


def test_memfds_take_at_most_their_share_of_the_daemons_fd_room_and_free_it_once_closed(stepped):
    """Each chunk is a memfd the daemon holds: past CHUNKS_FD_SHARE_PER_UID of its fd room a uid's next one
    is refused, and past CHUNKS_FD_SHARE anyone's (LIMIT_EXCEEDED, with the numbers); a freed chunk's place
    comes back once its fd is really closed."""
    kernel, memory = stepped
    room = FdRoom(16)
    memory.share_fd_room(room)
    room.take()  # a pidfd, say
    chunks = [memory.allocate_chunk(4096, host.DEVICE, 0, uid=1000)[1] for _ in range(2)]
    with pytest.raises(OverCap, match=r"no new chunk of 4.0 KiB for uid 1000: it keeps 2 chunks, .* one uid may "
                                      r"keep 2 \(12.5% of the daemon's 16 spare file descriptors\).*LimitNOFILE"):
        memory.allocate_chunk(4096, host.DEVICE, 0, uid=1000)
    chunks += [memory.allocate_chunk(4096, host.DEVICE, 0, uid=uid)[1] for uid in (2000, 2000, 3000, 3000, 4000,
                                                                                   4000, 5000, 5000, 6000)]
    assert room.used == 16 * host.CHUNKS_FD_SHARE
    with pytest.raises(OverCap, match=r"no new chunk of 4.0 KiB for uid 7000: .* take 12 of its 16 spare file "
                                      r"descriptors, and chunks may fill 75% .*LimitNOFILE"):
        memory.allocate_chunk(4096, host.DEVICE, 0, uid=7000)
    memory.free_chunk(chunks[0])
    assert room.used == 12, "still open: queued behind the held step"
    kernel.allow()
    wait_for(lambda: room.used == 11)
    chunks[0] = memory.allocate_chunk(4096, host.DEVICE, 0, uid=1000)[1]  # uid 1000 has room for one again
    for token in chunks:
        memory.free_chunk(token)
    wait_for(lambda: room.used == 1)


def test_ranges_match_a_set_of_bytes_under_any_adds_and_removes():
    """The reserver's bookkeeping of ranges to zero: merged, cut and searched as a plain set would be."""
    rng = random.Random(7)
    ranges, model = hostreserve.Ranges(), set()
    for _ in range(3000):
        start = rng.randrange(0, 200)
        end = start + rng.randrange(0, 30)
        roll = rng.random()
        if roll < 0.5:
            ranges.add(start, end)
            model |= set(range(start, end))
        elif roll < 0.8:
            ranges.remove(start, end)
            model -= set(range(start, end))
        else:  # a step's pieces: sorted, disjoint, some partly outside any range
            cuts = sorted(rng.sample(range(0, 230), 6))
            pieces = [(cuts[i], cuts[i + 1] - cuts[i]) for i in range(0, 6, 2)]
            ranges.remove_all(pieces)
            for offset, size in pieces:
                model -= set(range(offset, offset + size))
        assert ranges.total == len(model)
        probe = rng.randrange(0, 230)
        assert ranges.overlaps(probe, probe + 5) == bool(model & set(range(probe, probe + 5)))
        whole = ranges.front(10 ** 9, 10 ** 9)
        assert set().union(*(range(a, a + n) for a, n in whole)) == model
        assert all(n > 0 for _, n in whole) and all(a + n < b for (a, n), (b, _) in zip(whole, whole[1:])), "merged"
    pieces = ranges.front(50, 3)
    assert len(pieces) <= 3 and sum(n for _, n in pieces) <= 50 and all(set(range(a, a + n)) <= model for a, n in pieces)


def test_a_host_chunk_that_would_leave_the_machine_short_is_refused_with_the_numbers(monkeypatch):
    """Reservations under way count as taken: two that fit one at a time do not both fit."""
    limit = 16 << 30
    headroom = int(limit * host.HEADROOM_SHARE)
    monkeypatch.setattr(host, "_memory_room", lambda: (limit, headroom + (6 << 20)))
    kernel = HeldKernel(monkeypatch)
    memory = host.Memory()
    try:
        _, first = memory.allocate_chunk(4 << 20, host.DEVICE, 0)
        with pytest.raises(AllocationFailed) as refused:
            memory.allocate_chunk(4 << 20, host.DEVICE, 0)
        assert str(refused.value).startswith(f"cannot reserve 4194304 bytes (4.0 MiB) of shared memory: "
                                             f"{human(headroom + (2 << 20))} are available"), refused.value
        kernel.allow()
        wait_for(lambda: memory.ready(first))
        memory.free_chunk(first)
    finally:
        kernel.allow()
        memory.close()


@pytest.mark.parametrize("layout", ["v2", "v1"])
def test_the_tightest_memory_limit_of_the_daemons_cgroup_or_its_parents_bounds_the_room(tmp_path, layout):
    """A limit on a parent (a slice's MemoryMax=, a pod's) binds the daemon as much as its own."""
    membership = tmp_path / "cgroup"
    if layout == "v2":
        membership.write_text("0::/system.slice/peerd.service\n")
        files, base = ("memory.max", "memory.current"), tmp_path
    else:
        membership.write_text("9:memory:/system.slice/peerd.service\n8:pids:/system.slice/peerd.service\n")
        files, base = ("memory.limit_in_bytes", "memory.usage_in_bytes"), tmp_path / "memory"
    unlimited = "max" if layout == "v2" else str(1 << 63)
    for path, limit, used in (("", unlimited, 50 << 30), ("system.slice", str(8 << 30), 5 << 30),
                              ("system.slice/peerd.service", unlimited, 1 << 30)):
        (base / path).mkdir(parents=True, exist_ok=True)
        (base / path / files[0]).write_text(limit + "\n")
        (base / path / files[1]).write_text(f"{used}\n")
    assert host._cgroup_memory(str(membership), str(tmp_path)) == (8 << 30, 5 << 30)
    membership.write_text("0::/\n" if layout == "v2" else "9:memory:/\n")
    assert host._cgroup_memory(str(membership), str(tmp_path)) is None, "no limit anywhere"


def test_a_step_that_raises_anything_fails_its_chunk_and_the_threads_serve_on(monkeypatch):
    """Not only OSError: whatever a step raises, its chunk finishes (failed, with the reason), the
    bytes it promised stop counting, and the next chunk is still reserved; a second free closes nothing."""
    monkeypatch.setattr(hostreserve, "THREADS", 1)
    real, raised = os.posix_fallocate, []

    def flaky(fd, offset, nbytes):
        if not raised:
            raised.append(True)
            raise MemoryError("out of memory in the worker")
        real(fd, offset, nbytes)

    monkeypatch.setattr(hostreserve.os, "posix_fallocate", flaky)
    memory = host.Memory()
    try:
        _, broken = memory.allocate_chunk(1 << 20, host.DEVICE, 0)
        _, fine = memory.allocate_chunk(1 << 20, host.DEVICE, 0)
        wait_for(lambda: broken.finished and fine.finished)
        with pytest.raises(AllocationFailed, match="out of memory in the worker"):
            memory.ready(broken)
        assert memory.ready(fine) and memory._reserver.pending == 0
        memory.free_chunk(broken)
        memory.free_chunk(broken)  # twice: the arena never does, but its fd must not be closed twice
    finally:
        memory.free_chunk(fine)
        memory.close()


def test_a_thread_that_could_not_start_fails_its_chunk_and_leaves_close_whole(monkeypatch):
    """No thread (the process's limit): that chunk fails with the reason, and close() waits only on
    threads that ran, so the daemon's shutdown goes to its end."""
    monkeypatch.setattr(hostreserve, "THREADS", 2)
    real, started = threading.Thread.start, []

    def second_fails(self):
        if started:
            raise RuntimeError("can't start new thread")
        started.append(self)
        real(self)

    monkeypatch.setattr(threading.Thread, "start", second_fails)
    memory = host.Memory()
    with pytest.raises(AllocationFailed, match="can't start new thread"):
        memory.allocate_chunk(1 << 20, host.DEVICE, 0)
    memory.close()
    assert memory.promised == 0 and not started[0].is_alive()


def test_chunks_never_promise_more_than_the_memory_less_the_headroom_whatever_members_did_to_their_pages(monkeypatch):
    """A member holds its chunk's memfd and may punch its pages out: MemAvailable then shows that memory
    as free, but the daemon promised it (the next zeroing reserves it again). The chunks kept may promise
    at most the memory the daemon may use less the headroom, counted by their sizes, not by their pages."""
    limit = 64 << 20
    headroom = int(limit * host.HEADROOM_SHARE)
    monkeypatch.setattr(host, "_memory_room", lambda: (limit, 1 << 40))  # every page punched out: all available
    memory = host.Memory()
    try:
        chunks = [memory.allocate_chunk(16 << 20, host.DEVICE, 0)[1] for _ in range(3)]
        for chunk in chunks:
            wait_for(lambda: memory.ready(chunk))
            punch_out(chunk.fd, 0, 16 << 20)  # a member punches
        with pytest.raises(AllocationFailed) as refused:
            memory.allocate_chunk(16 << 20, host.DEVICE, 0)
        assert str(refused.value).startswith(
            f"cannot reserve 16777216 bytes (16.0 MiB) of shared memory: the daemon's chunks already take 48.0 MiB "
            f"of the {human(limit - headroom)} it may promise"), refused.value
        memory.free_chunk(chunks.pop())
        memory.free_chunk(chunks[0])  # twice: given back once
        memory.free_chunk(chunks[0])
        assert memory.promised == 16 << 20
        chunks[0] = memory.allocate_chunk(16 << 20, host.DEVICE, 0)[1]
        for chunk in chunks:
            memory.free_chunk(chunk)
        assert memory.promised == 0
    finally:
        memory.close()


def test_a_freed_range_is_reserved_again_only_while_memory_leaves_the_headroom(stepped, monkeypatch):
    """Pages punched out by a member may have been taken by others since: the zeroing reserves a freed
    range again only while the memory available (less the reservations under way) leaves the headroom,
    else the set handed it fails with the numbers and the range is tried again; nobody is OOM-killed."""
    kernel, memory = stepped
    limit = 1 << 30
    room = {"available": limit}
    monkeypatch.setattr(host, "_memory_room", lambda: (limit, room["available"]))
    _, chunk = memory.allocate_chunk(2 << 20, host.DEVICE, 0)
    kernel.allow(2)
    wait_for(lambda: memory.ready(chunk))
    room["available"] = int(limit * host.HEADROOM_SHARE)  # others took the memory
    memory.zero(chunk, 0, 1 << 20)
    wait_for(lambda: not chunk.zeroing.total)
    with pytest.raises(AllocationFailed, match="zero a freed range .*memory is short: .* so 1.0 MiB could not be reserved now; the range is zeroed again"):
        memory.ready(chunk, (0, 4096))
    assert len(kernel.calls) == 2, "no page of it was reserved again"
    room["available"] = limit
    kernel.allow(1)
    wait_for(lambda: memory.ready(chunk, (0, 1 << 20)))
    assert os.fstat(chunk.fd).st_blocks * 512 >= 2 << 20, "reserved again once there was room"
    memory.free_chunk(chunk)


def test_where_no_new_chunk_can_be_had_the_empty_chunks_nobody_maps_go_back_first():
    """Empty chunks are kept only to be used again: one user's idle ones must not keep another user from
    memory. A chunk that cannot be had is tried once more after they went back; the error stands where
    none could go back."""

    class TwoChunks(Chunks):
        def allocate_chunk(self, nbytes, device, flags, uid=None):
            if len(self.live) >= 2:
                raise AllocationFailed(f"out of memory on {device}")
            return super().allocate_chunk(nbytes, device, flags, uid)

    chunks = TwoChunks()
    memory = ArenaMemory(chunks, ArenaSettings(chunk_bytes=1 << 20, idle_s=600))
    idle = memory.allocate(100, "gpu0", 0, 1000)
    held = memory.allocate(100, "gpu0", 0, 2000)
    memory.free(idle)  # uid 1000's chunk is empty now, kept for its next buffer
    third = memory.allocate(100, "gpu0", 0, 3000)
    assert idle.token.chunk.token not in chunks.live and len(chunks.live) == 2, "the empty chunk went back"
    with pytest.raises(AllocationFailed, match="out of memory on gpu0"):
        memory.allocate(100, "gpu0", 0, 4000)  # both chunks in use: nothing to give back
    for allocation in (held, third):
        memory.free(allocation)
    memory.close()


class SlowCloses:
    """hostreserve's ``os`` with a close that waits for ``release``, then gives the chunk's memory back
    (``state["back"]``) unless a member still holds it (``state["held"]``)."""

    def __init__(self, state: dict):
        self._state, self.release, self.started = state, threading.Event(), threading.Event()

    def close(self, fd: int) -> None:
        self.started.set()
        assert self.release.wait(10), "the close was never released"
        os.close(fd)
        self._state["back"] = not self._state["held"]

    def __getattr__(self, name):
        return getattr(os, name)


def test_at_its_cap_a_uid_gives_its_own_empty_chunks_back_first_and_never_anothers():
    """A uid that holds no buffer must not be refused a bigger one because of the chunk it kept for its
    next buffers; another uid's empty chunk is not its to take, and the refusal stands where nothing of
    its own could go back."""
    chunks = Chunks()
    memory = ArenaMemory(chunks, ArenaSettings(chunk_bytes=1 << 20, cap_per_uid=5 << 19, idle_s=600))
    kept = memory.allocate(100, "gpu0", 0, 1000)
    others = memory.allocate(100, "gpu0", 0, 2000)
    memory.free(kept)
    memory.free(others)
    big = memory.allocate(2 << 20, "gpu0", 0, 1000)  # 1 MiB kept + 2 MiB would pass the cap of 2.5 MiB
    assert kept.token.chunk.token not in chunks.live and others.token.chunk.token in chunks.live
    with pytest.raises(OverCap, match="uid 1000 reserves 2097152 bytes .* cap of 2621440 bytes"):
        memory.allocate(1 << 20, "gpu0", 0, 1000)  # its big buffer is held: nothing of its own to give back
    memory.free(big)
    memory.close()


@pytest.mark.parametrize("held", [False, True], ids=["given-back", "held-elsewhere"])
def test_a_chunk_admitted_on_memory_still_closing_waits_for_the_close_then_fails_only_where_none_came_back(
        monkeypatch, held):
    """Empty chunks given back for a set are still closing when it is tried again: their memory counts,
    and the new chunk's reservation waits for the close; where the pages did not come back (a process
    still holds the closed memfd), it fails with the numbers instead of reserving memory that is not there."""
    monkeypatch.setattr(hostreserve, "THREADS", 2)
    monkeypatch.setattr(hostreserve, "STEP_BYTES", 1 << 20)
    limit, size = 1 << 30, 2 << 20
    short = int(limit * host.HEADROOM_SHARE) + size // 2  # one chunk fits only with the closing one's memory
    state = {"back": True, "held": held}
    monkeypatch.setattr(host, "_memory_room", lambda: (limit, short + (size if state["back"] else 0)))
    kernel = HeldKernel(monkeypatch)
    slow = SlowCloses(state)
    monkeypatch.setattr(hostreserve, "os", slow)
    memory = host.Memory()
    try:
        _, old = memory.allocate_chunk(size, host.DEVICE, 0)
        kernel.allow(2)
        wait_for(lambda: memory.ready(old))
        state["back"] = False  # its pages are in use
        memory.free_chunk(old)
        assert slow.started.wait(10) and memory._reserver.closing == size
        _, new = memory.allocate_chunk(size, host.DEVICE, 0)  # refused before: memory read as short
        kernel.allow()
        time.sleep(0.2)
        assert not memory.ready(new) and len(kernel.calls) == 2, "it waits for the close, reserving nothing"
        slow.release.set()
        if held:
            wait_for(lambda: new.error is not None)
            with pytest.raises(AllocationFailed, match=f"cannot reserve {size} bytes of shared memory: memory is short"):
                memory.ready(new)
            assert len(kernel.calls) == 2, "nothing reserved that is not there"
        else:
            wait_for(lambda: memory.ready(new))
            assert os.fstat(new.fd).st_blocks * 512 >= size
        assert memory._reserver.closing == 0
        memory.free_chunk(new)
    finally:
        slow.release.set()
        kernel.allow()
        memory.close()


def test_a_parked_chunk_zeroed_then_freed_is_closed_once_and_leaves_the_counts_whole(monkeypatch):
    """A chunk parked for memory, handed a freed range to zero (a set in it was released) and then freed:
    it sat in the parked list twice, and its fd was closed twice (whatever reused the number went with
    it), the fd room given back twice and ``closing`` left negative."""
    monkeypatch.setattr(hostreserve, "STEP_BYTES", 1 << 20)
    gate, closes, state = threading.Event(), [], {"short": False, "steps_allowed": 0}

    class GatedCloses:
        def close(self, fd):
            if fd == state.get("gated"):
                assert gate.wait(10)
            closes.append(fd)
            os.close(fd)

        def __getattr__(self, name):
            return getattr(os, name)

    def room(nbytes):
        if state["steps_allowed"]:
            state["steps_allowed"] -= 1
        elif state["short"]:
            raise AllocationFailed("memory is short")

    monkeypatch.setattr(hostreserve, "os", GatedCloses())
    given_back = []
    reserver = hostreserve.Reserver(closed=lambda: given_back.append(1), room=room)
    try:
        fds = []
        for size in (1 << 20, 4 << 20):
            fds.append(os.memfd_create("chunk"))
            os.ftruncate(fds[-1], size)
        old = reserver.reserve(fds[0], 1 << 20, 1000, b"old")
        wait_for(lambda: old.finished)
        state.update(gated=fds[0], short=True)
        reserver.free(old)  # its close is under way, and stays so
        state["steps_allowed"] = 1
        parked = reserver.reserve(fds[1], 4 << 20, 1000, b"parked", on_credit=True)
        wait_for(lambda: parked in reserver._parked)
        assert parked.reserved == 1 << 20, "one step, then memory read short with a close under way: it waits"
        reserver.zero(parked, 0, 4096)  # a set in it was released
        time.sleep(0.1)
        assert reserver._parked == [parked] and not parked.queued, "still parked, once"
        reserver.free(parked)
        wait_for(lambda: fds[1] in closes)
        gate.set()
        wait_for(lambda: len(given_back) == 2)
        time.sleep(0.1)
        assert sorted(closes) == sorted(fds), "each memfd closed once"
        assert len(given_back) == 2 and reserver.closing == 0 and reserver.pending == 0
    finally:
        gate.set()
        reserver.close()


def test_a_close_that_ends_during_a_chunks_room_check_lets_it_try_again_instead_of_failing(monkeypatch):
    monkeypatch.setattr(hostreserve, "STEP_BYTES", 1 << 20)
    released, state = threading.Event(), {"back": True, "racing": False}
    fds = {}

    class GatedCloses:
        def close(self, fd):
            if fd == fds.get("old"):
                assert released.wait(10)
                os.close(fd)
                state["back"] = True  # its pages are free
                return
            os.close(fd)

        def __getattr__(self, name):
            return getattr(os, name)

    def room(nbytes):
        if state["back"]:
            return
        if state["racing"]:  # memory read short, then the close ends before the chunk looks at the closes
            state["racing"] = False
            released.set()
            wait_for(lambda: not reserver.closing)
        raise AllocationFailed("memory is short")

    monkeypatch.setattr(hostreserve, "os", GatedCloses())
    reserver = hostreserve.Reserver(room=room)
    try:
        for name in ("old", "new"):
            fds[name] = os.memfd_create(name)
            os.ftruncate(fds[name], 2 << 20)
        old = reserver.reserve(fds["old"], 2 << 20, None, b"old")
        wait_for(lambda: reserver.ready(old))
        state["back"] = False
        reserver.free(old)
        wait_for(lambda: reserver.closing)
        state["racing"] = True
        new = reserver.reserve(fds["new"], 2 << 20, None, b"new", on_credit=True)
        wait_for(lambda: new.finished)
        assert new.error is None and reserver.ready(new), "the memory came back: reserved, not failed"
        reserver.free(new)
    finally:
        released.set()
        reserver.close()
