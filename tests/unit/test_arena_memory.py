"""ArenaMemory: the registry's allocate and free over a backend's chunks, and the thread that returns idle ones."""

import errno
import os
import select
import threading
import time

import pytest

from peerd.backends import AllocationFailed, ChunkMemory, host
from peerd.backends.arenas import ArenaMemory, ArenaSettings
from peerd.sizes import human


class Chunks(ChunkMemory):
    name = "fake"

    def __init__(self):
        self.live, self.zeroed, self.closed = set(), [], False

    def devices(self):
        return [{"uuid": "gpu0"}, {"uuid": "gpu1"}]

    def allocate_chunk(self, nbytes, device, flags):
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


def test_host_chunks_are_reserved_off_the_caller_and_a_failed_reservation_says_why(monkeypatch):
    """posix_fallocate of a big chunk takes seconds: the host backend runs it on a thread, wakes
    ``ready_fd`` once it ended, and ``ready`` then says yes, or raises the reason."""
    memory = host.Memory()
    go = threading.Event()
    real = os.posix_fallocate

    def held(fd, offset, nbytes):  # the kernel's work, made to wait for the test
        go.wait(10)
        if nbytes == 3 << 20:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, offset, nbytes)

    monkeypatch.setattr(host.os, "posix_fallocate", held)
    try:
        _, fine = memory.allocate_chunk(2 << 20, host.DEVICE, 0)
        _, short = memory.allocate_chunk(3 << 20, host.DEVICE, 0)
        assert not memory.ready(fine) and not memory.ready(short), "allocate_chunk returned before the reservation"
        assert not select.select([memory.ready_fd], [], [], 0)[0], "nothing to wake the loop for yet"
        go.set()
        woken, wait_for = b"", time.monotonic() + 10
        while len(woken) < 2 and select.select([memory.ready_fd], [], [], wait_for - time.monotonic())[0]:
            woken += os.read(memory.ready_fd, 4096)
        assert woken == b"\0\0", "the loop is woken once per chunk, after its reservation ended"
        assert memory.ready(fine) and os.fstat(fine.fd).st_blocks * 512 >= 2 << 20, "its pages are really there"
        with pytest.raises(AllocationFailed, match="cannot reserve 3145728 bytes of shared memory: .*No space left"):
            memory.ready(short)
        for token in (fine, short):
            memory.free_chunk(token)
    finally:
        memory.close()


def test_a_host_chunk_that_would_leave_the_machine_short_is_refused_with_the_numbers(monkeypatch):
    """Reservations under way count as taken: two that fit one at a time do not both fit."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    headroom = int(total * host.HEADROOM_SHARE)
    monkeypatch.setattr(host, "_mem_available", lambda: headroom + (6 << 20))
    go = threading.Event()
    monkeypatch.setattr(host, "_reserve", lambda fd, nbytes: go.wait(10) and os.close(fd))
    memory = host.Memory()
    try:
        _, first = memory.allocate_chunk(4 << 20, host.DEVICE, 0)
        with pytest.raises(AllocationFailed) as refused:
            memory.allocate_chunk(4 << 20, host.DEVICE, 0)
        assert str(refused.value).startswith(f"cannot reserve 4194304 bytes (4.0 MiB) of shared memory: the machine has "
                                             f"{human(headroom + (2 << 20))} available"), refused.value
        go.set()
        wait_for = time.monotonic() + 10
        while not memory.ready(first) and time.monotonic() < wait_for:
            time.sleep(0.01)
        memory.free_chunk(first)
    finally:
        go.set()
        memory.close()
