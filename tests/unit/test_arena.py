"""The arena allocator's rules, against a chunk source that records what it was asked."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peerd.arena import ALIGNMENT, Arenas, OverCap, align, describe_usage

CHUNK = 64 * ALIGNMENT


class Source:
    """Chunks as bytearrays; zeroing runs when synced, as a device stream would. Like a GPU's, freeing one
    a process still maps would be undefined (Note [No free under a mapping])."""

    free_needs_unmapped = True
    ready_per_range = False

    def __init__(self):
        self.memory: dict[int, bytearray] = {}
        self.pending: dict[int, list[tuple[int, int]]] = {}
        self.freed: list[int] = []
        self.failed: set[int] = set()  # chunks whose memory the backend could not have after all
        self.spans: list[tuple[int, tuple[int, int]]] = []  # (chunk, span) asked about
        self.syncs = 0
        self._next = 0

    def allocate_chunk(self, nbytes, device, flags, uid=None):
        self._next += 1
        self.memory[self._next] = bytearray(nbytes)
        return b"chunk%d" % self._next, self._next

    def ready(self, token, span=None):
        if token in self.failed:
            raise RuntimeError(f"chunk {token} could not be reserved")
        if span is not None:
            self.spans.append((token, span))
            return not any(offset == span[0] for offset, _ in self.pending.get(token, []))
        return True

    def zero(self, token, offset, nbytes):
        self.pending.setdefault(token, []).append((offset, nbytes))

    def sync(self, token):
        self.syncs += 1
        for offset, nbytes in self.pending.pop(token, []):
            self.memory[token][offset:offset + nbytes] = bytes(nbytes)

    def free_chunk(self, token):
        self.pending.pop(token, None)  # a backend waits for its zeroing (a GPU) or stops it (host memory)
        self.freed.append(token)
        del self.memory[token]


@pytest.fixture
def source():
    return Source()


@pytest.fixture
def arenas(source):
    return Arenas(source, CHUNK, cap_per_uid=None, idle_s=10)


def test_sizes_are_aligned_not_rounded_to_gpu_pages(arenas):
    a = arenas.place(1, "gpu0", 0, 1000)
    b = arenas.place(8192, "gpu0", 0, 1000)
    c = arenas.place(8193, "gpu0", 0, 1000)
    assert (a.size, b.size, c.size) == (ALIGNMENT, 8192, 3 * ALIGNMENT)
    assert [p.offset % ALIGNMENT for p in (a, b, c)] == [0, 0, 0]
    assert a.chunk is b.chunk is c.chunk and len(arenas.chunks) == 1
    assert align(0) == 0 and align(ALIGNMENT) == ALIGNMENT


def test_eight_ranks_of_8_kib_take_64_kib(arenas):
    placed = [arenas.place(8 << 10, "gpu0", 0, 1000) for _ in range(8)]
    assert sum(p.size for p in placed) == 64 << 10
    assert arenas.usage() == [{"device": "gpu0", "uid": 1000, "chunks": 1, "reserved_bytes": CHUNK,
                               "handed_out_bytes": 64 << 10}]


def test_a_chunk_serves_one_uid_one_device_and_one_kind(arenas):
    mine = arenas.place(4096, "gpu0", 0, 1000)
    theirs = arenas.place(4096, "gpu0", 0, 1001)
    other_device = arenas.place(4096, "gpu1", 0, 1000)
    fine = arenas.place(4096, "gpu0", 1, 1000)
    assert len({id(p.chunk) for p in (mine, theirs, other_device, fine)}) == 4
    assert theirs.chunk.uid == 1001


def test_a_freed_range_waits_while_the_chunk_has_room_and_needs_no_sync(arenas, source):
    first = arenas.place(8192, "gpu0", 0, 1000)
    arenas.release(first, now=0)
    second = arenas.place(8192, "gpu0", 0, 1000)
    assert second.chunk is first.chunk and second.offset != first.offset
    assert source.syncs == 0, "a range never handed out needs no wait for a zeroing"


def test_a_freed_range_is_reused_once_nothing_else_fits_and_reads_zero(arenas, source):
    first = arenas.place(8192, "gpu0", 0, 1000)
    token = first.chunk.token
    source.memory[token][first.offset:first.offset + 8192] = b"\xff" * 8192
    rest = arenas.place(CHUNK - 8192, "gpu0", 0, 1000)
    arenas.release(first, now=0)
    again = arenas.place(8192, "gpu0", 0, 1000)
    assert (again.chunk, again.offset) == (first.chunk, first.offset) and rest.chunk is first.chunk
    assert source.syncs == 1 and len(arenas.chunks) == 1, "the zeroing range is waited for, not a new chunk made"
    assert source.memory[token][again.offset:again.offset + 8192] == bytes(8192)


def test_a_range_the_driver_failed_to_zero_is_never_handed_out_again(arenas, source):
    class Refused(Exception):
        pass

    def refuse(token, offset, nbytes):
        raise Refused("the driver refused the memset")

    first = arenas.place(CHUNK, "gpu0", 0, 1000)
    source.zero = refuse
    with pytest.raises(Refused):
        arenas.release(first, now=0)
    assert arenas.place(4096, "gpu0", 0, 1000).chunk is not first.chunk
    assert first.chunk.free == [] and first.chunk.handed_out == 0
    assert arenas.sweep(now=10) == [first.chunk], "the emptied chunk still goes back to the driver"


def test_no_sync_when_nothing_was_freed(arenas, source):
    arenas.place(4096, "gpu0", 0, 1000)
    arenas.place(4096, "gpu0", 0, 1000)
    assert source.syncs == 0


def test_freed_neighbours_coalesce_into_one_range_once_zeroed(arenas, source):
    a, b, c = (arenas.place(4 * ALIGNMENT, "gpu0", 0, 1000) for _ in range(3))
    rest = arenas.place(CHUNK - 12 * ALIGNMENT, "gpu0", 0, 1000)
    assert rest.chunk is a.chunk and not a.chunk.free
    arenas.release(a, now=0)
    arenas.release(c, now=0)
    arenas.release(b, now=0)
    assert a.chunk.free == [] and len(a.chunk.zeroing) == 3, "nothing rejoins the free list before its zeroing"
    big = arenas.place(12 * ALIGNMENT, "gpu0", 0, 1000)
    assert big.offset == 0 and big.chunk is a.chunk and source.syncs == 1


def test_a_full_chunk_makes_another(arenas):
    first = arenas.place(CHUNK, "gpu0", 0, 1000)
    second = arenas.place(4096, "gpu0", 0, 1000)
    assert second.chunk is not first.chunk and len(arenas.chunks) == 2


def test_a_request_bigger_than_a_chunk_gets_its_own_and_frees_it_at_once(arenas, source):
    big = arenas.place(CHUNK + 1, "gpu0", 0, 1000)
    assert big.chunk.dedicated and big.chunk.size == CHUNK + ALIGNMENT and big.offset == 0
    small = arenas.place(4096, "gpu0", 0, 1000)
    assert small.chunk is not big.chunk
    arenas.release(big, now=0)
    assert source.freed == [big.chunk.token] and big.chunk.id not in arenas.chunks


def test_the_cap_counts_reserved_chunks_per_uid(source):
    arenas = Arenas(source, CHUNK, cap_per_uid=CHUNK, idle_s=10)
    arenas.place(CHUNK, "gpu0", 0, 1000)
    with pytest.raises(OverCap, match=rf"uid 1000 reserves {CHUNK} bytes .* on gpu1 .* cap of {CHUNK} bytes"):
        arenas.place(4096, "gpu1", 0, 1000)
    assert arenas.place(4096, "gpu0", 0, 1001).chunk.uid == 1001  # another uid has its own cap
    assert len(source.memory) == 2


def test_where_the_backend_tells_readiness_by_range_a_zeroing_range_goes_out_without_a_wait(source):
    """Host memory is zeroed on threads: a range still zeroing is handed out at once, no sync on the caller,
    and its readiness is asked for that range (the set opens once it is zeroed)."""
    source.ready_per_range = True
    arenas = Arenas(source, CHUNK, idle_s=10)
    full = arenas.place(CHUNK, "host", 0, 1000)
    assert arenas.ready(full.chunk, (0, CHUNK))
    arenas.release(full, now=0)
    again = arenas.place(CHUNK, "host", 0, 1000)
    assert again.chunk is full.chunk and source.syncs == 0, "the zeroing range went out, nothing waited"
    assert not arenas.ready(again.chunk, (again.offset, again.size)), "not ready while it is being zeroed"
    assert arenas.ready(again.chunk) and source.spans[-1] == (again.chunk.token, (0, CHUNK))
    source.sync(again.chunk.token)
    assert arenas.ready(again.chunk, (again.offset, again.size))


def test_an_empty_chunk_goes_back_only_after_idle_s(arenas, source):
    p = arenas.place(4096, "gpu0", 0, 1000)
    arenas.release(p, now=100.0)
    assert arenas.next_sweep() == 110.0
    assert arenas.sweep(now=109.9) == [] and len(arenas.chunks) == 1
    assert [c.token for c in arenas.sweep(now=110.0)] == [p.chunk.token]
    assert source.freed == [p.chunk.token] and arenas.usage() == [] and arenas.next_sweep() is None


def test_a_chunk_used_again_is_not_idle(arenas, source):
    p = arenas.place(4096, "gpu0", 0, 1000)
    arenas.release(p, now=0.0)
    arenas.place(4096, "gpu0", 0, 1000)
    assert arenas.sweep(now=1000.0) == [] and source.freed == []


def test_trim_frees_every_empty_chunk_and_keeps_used_ones(arenas, source):
    kept = arenas.place(4096, "gpu0", 0, 1000)
    gone = arenas.place(4096, "gpu1", 0, 1000)
    arenas.release(gone, now=0.0)
    assert [c.token for c in arenas.trim()] == [gone.chunk.token]
    assert list(arenas.chunks.values()) == [kept.chunk]


def test_once_the_daemon_stops_a_freed_range_keeps_its_data_and_never_goes_out_again(arenas, source):
    """A worker still maps its buffer while the daemon shuts down, and its kernel may still poll it: a range
    zeroed under it would read as a peer's signal, and a chunk freed under it is undefined (a chunk of its
    own has no mappers on record). Nothing is zeroed; trim gives back only chunks no range was freed in."""
    kept, mapped = arenas.place(4096, "gpu0", 0, 1000), arenas.place(4096, "gpu1", 0, 1000)
    big, idle = arenas.place(2 * CHUNK, "gpu2", 0, 1000), arenas.place(4096, "gpu3", 0, 1000)
    arenas.handed([mapped, big], [7])
    arenas.release(idle, now=0.0)  # emptied before the shutdown: nobody holds it
    for p in (kept, mapped):
        source.memory[p.chunk.token][p.offset:p.offset + 4] = b"flag"
    arenas.stopping()
    arenas.release(kept, now=0.0)
    arenas.release(mapped, now=0.0)
    arenas.release(big, now=0.0)
    assert source.pending.get(kept.chunk.token) is None and kept.chunk.zeroing == [], "nothing zeroed at shutdown"
    assert all(source.memory[p.chunk.token][p.offset:p.offset + 4] == b"flag" for p in (kept, mapped))
    again = arenas.place(4096, "gpu0", 0, 1000)
    assert (again.chunk, again.offset) != (kept.chunk, kept.offset), "a range left as it is never goes out again"
    arenas.release(again, now=0.0)
    assert [c.token for c in arenas.trim()] == [idle.chunk.token] and source.freed == [idle.chunk.token]
    assert all(p.chunk.token in source.memory for p in (kept, mapped, big)), "a worker may still map them"


def test_the_chunk_size_must_be_aligned(source):
    with pytest.raises(ValueError, match="multiple of 4096"):
        Arenas(source, CHUNK + 1)


def test_idle_s_zero_gives_an_emptied_chunk_back_at_once(source):
    arenas = Arenas(source, CHUNK, idle_s=0)
    a, b = arenas.place(4096, "gpu0", 0, 1000), arenas.place(4096, "gpu0", 0, 1000)
    arenas.release(a, now=0)
    assert source.freed == []
    arenas.release(b, now=0)
    assert source.freed == [a.chunk.token] and not arenas.chunks


def test_usage_reads_as_one_line_per_uid(arenas):
    arenas.place(8192, "gpu0", 0, 1000)
    assert [u for u in arenas.usage()] == [{"device": "gpu0", "uid": 1000, "chunks": 1,
                                            "reserved_bytes": CHUNK, "handed_out_bytes": 8192}]
    assert describe_usage(arenas.usage()) == ["arena of uid 1000: 1 chunk(s), 256.0 KiB reserved, 8.0 KiB handed out"]


def test_a_range_that_could_not_be_zeroed_is_never_handed_out_again(arenas, source):
    p = arenas.place(4096, "gpu0", 0, 1000)

    def broken(token, offset, nbytes):
        raise RuntimeError("the driver refused the memset")

    source.zero = broken
    with pytest.raises(RuntimeError):
        arenas.release(p, now=0)
    assert arenas.place(4096, "gpu0", 0, 1000).offset != p.offset


def test_a_shared_chunk_stays_while_a_process_it_was_handed_lives(arenas, source):
    """Note [No free under a mapping]: empty and idle is not enough while pid 7 may still map it."""
    a = arenas.place(ALIGNMENT, "gpu0", 0, 1000)
    arenas.handed([a], [7, 8])
    arenas.release(a, 0.0)
    assert arenas.sweep(100.0) == [] and arenas.trim() == [] and arenas.next_sweep() is None
    assert arenas.process_gone(7, 100.0) == [] and source.freed == []
    assert [c.id for c in arenas.process_gone(8, 100.0)] == [a.chunk.id] and source.freed == [a.chunk.token]


def test_a_dedicated_chunk_goes_back_at_release_whoever_was_handed_it(arenas, source):
    """Every member unmaps a whole-chunk buffer before its release, so no record is kept for one."""
    big = arenas.place(2 * CHUNK, "gpu0", 0, 1000)
    arenas.handed([big], [7])
    arenas.release(big, 0.0)
    assert source.freed == [big.chunk.token]


def test_an_evicted_chunk_goes_back_only_once_the_live_processes_it_was_taken_from_exited(arenas, source):
    """An eviction takes the hold from members that still map it: a chunk of its own too must not reach
    the driver (and so another uid) under them; it goes once the last exited, with no idle wait."""
    big, small = arenas.place(2 * CHUNK, "gpu0", 0, 1000), arenas.place(ALIGNMENT, "gpu0", 0, 1000)
    arenas.release(big, 0.0, mapped_by=[7, 8])
    arenas.release(small, 0.0, mapped_by=[7])
    assert source.freed == [] and arenas.trim() == [] and arenas.sweep(100.0) == []
    assert arenas.place(2 * CHUNK, "gpu0", 0, 1000).chunk is not big.chunk, "an evicted chunk takes nothing more"
    assert arenas.process_gone(7, 1.0) == [] and source.freed == []
    assert [c.id for c in arenas.process_gone(8, 1.0)] == [big.chunk.id]
    assert arenas.chunks.get(small.chunk.id) is small.chunk, "a shared chunk still waits its idle time"


def test_a_driver_refusing_a_free_costs_that_chunk_alone(arenas, source, caplog):
    """A device fault on one cudaFree must not stop the other chunks, nor the death that freed them."""
    a, b = arenas.place(2 * CHUNK, "gpu0", 0, 1000), arenas.place(2 * CHUNK, "gpu0", 0, 2000)
    real = source.free_chunk

    def refuse_a(token):
        if token == a.chunk.token:
            raise RuntimeError("cudaFree on device 0 failed: cudaErrorECCUncorrectable")
        real(token)

    source.free_chunk = refuse_a
    arenas.release(a, 0.0, mapped_by=[7])
    arenas.release(b, 0.0, mapped_by=[7])
    assert {c.id for c in arenas.process_gone(7, 1.0)} == {a.chunk.id, b.chunk.id}
    assert source.freed == [b.chunk.token] and arenas.chunks == {} and arenas._reserved == {}
    assert "cudaErrorECCUncorrectable" in caplog.text and f"chunk {a.chunk.id} of uid 1000" in caplog.text


def test_where_the_mapping_keeps_memory_alive_chunks_go_back_when_idle(source):
    source.free_needs_unmapped = False  # memfds
    arenas = Arenas(source, CHUNK, idle_s=10)
    a = arenas.place(ALIGNMENT, "host", 0, 1000)
    arenas.handed([a], [7])
    arenas.release(a, 0.0)
    assert [c.id for c in arenas.sweep(10.0)] == [a.chunk.id]


def test_a_forsaken_chunk_takes_no_new_buffer_and_goes_back_with_its_last_one_unzeroed(arenas, source):
    """Its memory could not be reserved after all: the sets in it fail, nothing more is placed there,
    and it is freed, not zeroed, once they are released."""
    a, b = arenas.place(4096, "gpu0", 0, 1000), arenas.place(4096, "gpu0", 0, 1000)
    arenas.forsake(a.chunk)
    c = arenas.place(4096, "gpu0", 0, 1000)
    assert c.chunk is not a.chunk, "a new chunk, not the forsaken one"
    arenas.release(a, 0.0)
    assert source.freed == [] and a.chunk.id in arenas.chunks, "b is still in it"
    arenas.release(b, 0.0)
    assert source.freed == [a.chunk.token] and not source.pending, "freed at its last release, nothing zeroed"
    empty = arenas.place(CHUNK, "gpu0", 0, 2000)
    arenas.forsake(empty.chunk)
    arenas.release(empty, 0.0)
    arenas.forsake(empty.chunk)  # every set in it hears the failure: forsaken more than once
    assert source.freed == [a.chunk.token, empty.chunk.token]


def test_a_chunk_that_failed_unasked_is_forsaken_when_the_next_buffer_would_go_in_it(arenas, source):
    """Every set in it failed for another reason (a timeout) before any asked whether it was ready:
    the next buffer goes to a new chunk, not into memory that is not there."""
    a = arenas.place(4096, "gpu0", 0, 1000)
    source.failed.add(a.chunk.token)
    b = arenas.place(4096, "gpu0", 0, 1000)
    assert b.chunk is not a.chunk and a.chunk.forsaken
    arenas.release(a, 0.0)
    assert source.freed == [a.chunk.token]
    assert arenas.ready(b.chunk)
    source.failed.add(b.chunk.token)
    with pytest.raises(RuntimeError, match="could not be reserved"):
        arenas.ready(b.chunk)  # a set asking: it hears the error, and the chunk takes nothing more
    assert b.chunk.forsaken and arenas.place(4096, "gpu0", 0, 1000).chunk is not b.chunk



def test_a_placement_that_finds_an_empty_chunk_failed_unasked_drops_it_and_goes_on(arenas, source):
    """Its reservation failed while it was empty: the placement that finds it forsakes it, which drops it
    from the very chunks it is walking; the buffer goes to a new chunk (before, the walk raised, and the
    join was answered INTERNAL)."""
    a = arenas.place(4096, "gpu0", 0, 1000)
    arenas.release(a, 0.0)
    source.failed.add(a.chunk.token)
    b = arenas.place(4096, "gpu0", 0, 1000)
    assert b.chunk is not a.chunk and a.chunk.id not in arenas.chunks and source.freed == [a.chunk.token]

def test_a_forsaken_chunk_a_process_was_handed_leaves_nothing_kept_for_that_process(arenas, source):
    """Its memory failed after its handles went out: it goes back with its last buffer, and the pid's
    death later finds nothing of it."""
    a = arenas.place(4096, "gpu0", 0, 1000)
    arenas.handed([a], [7])
    source.failed.add(a.chunk.token)
    with pytest.raises(RuntimeError, match="could not be reserved"):
        arenas.ready(a.chunk)
    arenas.release(a, 0.0)
    assert source.freed == [a.chunk.token] and arenas._mapped == {} and arenas._reserved == {}
    assert arenas.process_gone(7, 100.0) == []

arena_event = st.one_of(
    st.tuples(st.just("place"), st.sampled_from([1, 3 * ALIGNMENT, CHUNK // 2, 2 * CHUNK]), st.sampled_from([1000, 2000]),
              st.sampled_from(["gpu0", "gpu1"])),
    st.tuples(st.just("release"), st.integers(0, 3)),
    st.tuples(st.just("evict"), st.integers(0, 3), st.sampled_from([7, 8, 9])),  # released under a live mapper
    st.tuples(st.just("hand"), st.integers(0, 3), st.sampled_from([7, 8, 9])),
    st.tuples(st.just("gone"), st.sampled_from([7, 8, 9])),
    st.tuples(st.just("sync"), st.integers(0, 3)),
    st.tuples(st.just("wait"), st.floats(0, 20)),
    st.tuples(st.just("trim")),
    st.tuples(st.just("fail"), st.integers(0, 3)),  # the backend could not have its memory after all
)


@settings(max_examples=300, deadline=None)
@given(st.lists(arena_event, max_size=40))
def test_no_sequence_leaks_a_chunk_overlaps_a_range_or_leaves_a_stale_index(events):
    """What is kept by uid and by pid, so that a placement, a cap check or a death looks at its own chunks
    alone, is exactly what a walk over every chunk would find, after every event."""
    source = Source()
    arenas = Arenas(source, CHUNK, idle_s=10)
    placed, now = [], 0.0

    def check():
        shared, reserved, mapped = {}, {}, {}
        for c in arenas.chunks.values():
            reserved[c.uid] = reserved.get(c.uid, 0) + c.size
            if not c.dedicated:
                shared.setdefault((c.uid, c.device, c.flags), {})[c.id] = c
            for pid in c.mappers:
                mapped.setdefault(pid, {})[c.id] = c
            spans = sorted([*c.used.items(), *map(tuple, c.free), *c.zeroing])
            assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:])), f"overlapping ranges in {c.id}"
        assert arenas._shared == shared and arenas._reserved == reserved and arenas._mapped == mapped
        assert set(source.memory) == {c.token for c in arenas.chunks.values()}, "a chunk freed, or forgotten"

    for ev in events:
        kind = ev[0]
        if kind == "place":
            placed.append(arenas.place(ev[1], ev[3], 0, ev[2]))
        elif kind == "release" and ev[1] < len(placed):
            arenas.release(placed.pop(ev[1]), now)
        elif kind == "evict" and ev[1] < len(placed):
            p = placed.pop(ev[1])
            arenas.release(p, now, mapped_by=[ev[2]])
            if p.chunk.id in arenas.chunks and not p.chunk.forsaken:
                assert ev[2] in p.chunk.mappers, "a chunk released under a live mapper is kept for it"
        elif kind == "hand" and ev[1] < len(placed):
            arenas.handed([placed[ev[1]]], [ev[2]])
        elif kind == "gone":
            arenas.process_gone(ev[1], now)
        elif kind == "sync" and ev[1] < len(placed):
            source.sync(placed[ev[1]].chunk.token)
        elif kind == "wait":
            now += ev[1]
            arenas.sweep(now)
        elif kind == "trim":
            arenas.trim()
        elif kind == "fail" and ev[1] < len(placed):
            source.failed.add(placed[ev[1]].chunk.token)
            with pytest.raises(RuntimeError):
                arenas.ready(placed[ev[1]].chunk)
        check()
    for p in placed:
        arenas.release(p, now)
    for pid in (7, 8, 9):
        arenas.process_gone(pid, now)
    arenas.sweep(now + 100)
    assert arenas.chunks == {} and source.memory == {} and arenas._reserved == {} and arenas._mapped == {}
