"""The reference all-reduce on the host backend: the same layout and protocol
as the GPU kernel, run by real rank processes against a real daemon."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import pytest
import torch

from peerd_client.allreduce import Layout, all_reduce, capacity
from tests.allreduce_rank import start
from tests.conftest import finish


@pytest.mark.parametrize("npes", [2, 4, 8])
def test_every_call_matches_the_plain_sum(daemon, npes):
    calls = 48
    procs = start(daemon, npes, "--group", f"ar{npes}", "--calls", str(calls))
    for r in (finish(p) for p in procs):
        assert r["ok"], r
        assert r["failures"] == [], r["failures"]
        assert r["calls"] == r["epoch"] == calls, "the epoch in the buffer counts the calls"
    assert daemon.settled_segments() == []


def fake_buffers(npes: int, nbytes: int) -> list[SimpleNamespace]:
    """What all_reduce uses of npes PeerBuffers, over this process's memory."""
    memory = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(npes)]
    pointers = [m.data_ptr() for m in memory]
    return [
        SimpleNamespace(rank=r, npes=npes, nbytes=nbytes, local=pointers[r], pointers=pointers, memory=memory,
                        addresses=torch.tensor(pointers), group_key="local", name="default")
        for r in range(npes)
    ]


def epoch_of(buf) -> int:
    return ctypes.c_int64.from_address(buf.local).value


@pytest.mark.parametrize("npes,nbytes", [(1, 4096), (2, 65536), (8, 1 << 20), (15, 3 * 4096 + 5)])
def test_the_layout_fits_the_buffer_and_nothing_overlaps(npes, nbytes):
    layout = Layout(npes, nbytes)
    words = [0] + [layout.flag(p) for p in range(npes)]
    assert words == list(range(0, 8 * (npes + 1), 8)) and words[-1] + 8 <= layout.header
    assert layout.header % 128 == 0 and layout.slot % 128 == 0 and layout.slot > 0
    assert [layout.slot_at(e) for e in (1, 2, 3, 4)] == [layout.header + layout.slot, layout.header] * 2
    assert layout.header + 2 * layout.slot <= nbytes < layout.header + 2 * layout.slot + 2 * 128


def test_one_rank_returns_its_input_and_counts_calls():
    (buf,) = fake_buffers(1, 8192)
    for call in range(1, 4):
        x = torch.randn(capacity(buf) // 4)
        assert torch.equal(all_reduce(buf, x), x)
        assert epoch_of(buf) == call
    y = torch.randn(3, 5).to(torch.bfloat16)
    assert torch.equal(all_reduce(buf, y.clone(), out=torch.empty_like(y)), y)
    assert all_reduce(buf, torch.zeros(0)).numel() == 0 and epoch_of(buf) == 4, "an empty call is no call"


def test_what_cannot_be_reduced_is_refused_before_touching_the_buffer():
    (buf,) = fake_buffers(1, 8192)
    fits = capacity(buf) // 4
    with pytest.raises(ValueError, match="do not fit this buffer's slot"):
        all_reduce(buf, torch.zeros(fits + 1))
    with pytest.raises(TypeError, match="float16"):
        all_reduce(buf, torch.zeros(4, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous"):
        all_reduce(buf, torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match="out must be"):
        all_reduce(buf, torch.zeros(4), out=torch.zeros(5))
    assert epoch_of(buf) == 0 and not buf.memory[0].any()
    buf.addresses = None  # as close() leaves it
    with pytest.raises(ValueError, match="group=local name=default.* is closed"):
        all_reduce(buf, torch.zeros(4))


def test_a_peer_that_never_comes_is_a_timeout_naming_it():
    ranks = fake_buffers(3, 8192)
    with pytest.raises(TimeoutError, match="rank 1 of group=local name=default did not reach all_reduce call 1"):
        all_reduce(ranks[0], torch.ones(4), timeout=0.2)
