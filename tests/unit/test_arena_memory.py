"""ArenaMemory: the registry's allocate and free over a backend's chunks, and the thread that returns idle ones."""

import time

from peerd.backends import ChunkMemory
from peerd.backends.arenas import ArenaMemory, ArenaSettings


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
