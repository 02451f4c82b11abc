"""The client's chunk mappings: one per chunk and daemon run, unmapped when their run ended and no buffer uses them."""

from __future__ import annotations

from peerd.backends import Mapper
from peerd_client.mappings import MappingCache


class RecordingMapper(Mapper):
    """Maps nothing: hands out made-up addresses and records what was closed."""

    def __init__(self) -> None:
        self.closed: list[int] = []
        self._next = 0x1000

    def device_identity(self, index):
        return "none"

    def open(self, handle, size, fd=None):
        self._next += 0x1000
        return self._next

    def close(self, address, size):
        self.closed.append(address)


def test_a_daemon_restarted_with_its_predecessors_pid_keeps_its_own_chunks():
    """In a container a restarted daemon may get its predecessor's pid (PID 1): retiring the old run
    unmaps the old run's chunks, never the new run's, even under the same handle bytes."""
    mapper, cache = RecordingMapper(), MappingCache()
    old_run, new_run = (1, 0xA), (1, 0xB)
    old = cache.open(mapper, (old_run, b"chunk"), 4096)
    cache.close((old_run, b"chunk"))  # shared chunk: stays mapped for the next buffer in it
    new = cache.open(mapper, (new_run, b"chunk"), 4096)
    assert new != old  # the new run's chunk is a mapping of its own, not the old run's

    cache.retire(old_run)
    assert mapper.closed == [old]
    assert list(cache._open) == [(new_run, b"chunk")]


def test_a_retired_runs_chunk_in_use_goes_at_its_last_close():
    mapper, cache = RecordingMapper(), MappingCache()
    run = (7, 0xA)
    address = cache.open(mapper, (run, b"chunk"), 4096)
    cache.open(mapper, (run, b"chunk"), 4096)  # a second buffer of this process in the same chunk
    cache.retire(run)
    cache.close((run, b"chunk"))
    assert mapper.closed == []  # one buffer still uses it
    cache.close((run, b"chunk"))
    assert mapper.closed == [address] and len(cache) == 0


class FdMapper(RecordingMapper):
    passes_fds = True  # the host backend's: chunks come as fds, and the daemon may give one back under a mapping


def test_a_new_fd_chunk_lets_go_of_the_fd_chunks_no_buffer_uses_and_a_claim_is_all_or_nothing():
    """Note [Given-back host chunks]: a worker kept every host chunk it had used mapped, one more per idle
    cycle of the daemon, for its whole life."""
    mapper, cache = FdMapper(), MappingCache()
    run = (7, 0xA)
    first = cache.open(mapper, (run, b"one"), 4096, fd=3)
    cache.open(mapper, (run, b"two"), 4096, fd=4)
    cache.close((run, b"one"))
    assert cache.claim([(run, b"two"), (run, b"two")]) and cache.address((run, b"two")), "mapped: no fd needed"
    assert not cache.claim([(run, b"two"), (run, b"gone")]), "one missing: the set fetches its fds"
    cache.open(mapper, (run, b"three"), 4096, fd=5)
    assert mapper.closed == [first], "the chunk no buffer used went as another was mapped"
    assert sorted(key[1] for key in cache._open) == [b"three", b"two"]
    for _ in range(3):  # the claim's two uses and the open's one: still used, still mapped
        cache.close((run, b"two"))
    cache.open(mapper, (run, b"four"), 4096, fd=6)
    assert len(mapper.closed) == 2 and sorted(key[1] for key in cache._open) == [b"four", b"three"]
