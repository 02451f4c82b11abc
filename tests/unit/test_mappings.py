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
    assert cache.mapped((new_run, b"chunk")) and not cache.mapped((old_run, b"chunk"))


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
