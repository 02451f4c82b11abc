"""A GPU mapper closes a handle in the device context that opened it, whichever device the closing
thread is on: a finalizer or the client's retry thread may be current on another GPU of the node.
The runtimes here are fakes that track the calling thread's current device, as the real ones do."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import pytest

from peerd.backends import cuda, hip


class FakeRuntime:
    """The calls a mapper makes, answered as (error, *values) with error 0 (success)."""

    def __init__(self, prefix: str) -> None:
        self.current = 0
        self.closed: list[tuple[int, int]] = []  # (address, the device current when it was closed)
        self._next = 0x7000_0000
        setattr(self, f"{prefix}GetDevice", lambda: (0, self.current))
        setattr(self, f"{prefix}SetDevice", self._set)
        setattr(self, f"{prefix}IpcOpenMemHandle", self._open)
        setattr(self, f"{prefix}IpcCloseMemHandle", lambda address: (self.closed.append((address, self.current)), (0,))[1])
        # what cuda-bindings' result checks and handle structs need
        self.cudaError_t = SimpleNamespace(cudaSuccess=0)
        self.cudaIpcMemLazyEnablePeerAccess = self.hipIpcMemLazyEnablePeerAccess = 1
        self.cudaIpcMemHandle_t = lambda: SimpleNamespace(getPtr=lambda b=ctypes.create_string_buffer(64): ctypes.addressof(b))

    def _set(self, ordinal):
        self.current = ordinal
        return (0,)

    def _open(self, handle, flags):
        self._next += 0x20_0000
        return (0, self._next)


def cuda_mapper(rt: FakeRuntime) -> cuda.Mapper:
    mapper = cuda.Mapper.__new__(cuda.Mapper)
    mapper._rt, mapper._opened_on = rt, {}
    return mapper


def hip_mapper(rt: FakeRuntime) -> hip.Mapper:
    mapper = hip.Mapper.__new__(hip.Mapper)
    mapper._hip, mapper._opened_on = SimpleNamespace(rt=rt), {}
    return mapper


def opened_on(device: int, prefix: str, make):
    """A fake runtime, a mapper over it, and a chunk that mapper opened on ``device``."""
    rt = FakeRuntime(prefix)
    mapper = make(rt)
    rt.current = device
    return rt, mapper, mapper.open(b"\0" * 64, 4096)


BOTH = pytest.mark.parametrize("prefix, make", [("cuda", cuda_mapper), ("hip", hip_mapper)])


@BOTH
def test_a_handle_is_closed_on_the_device_that_opened_it_and_the_caller_keeps_its_own(prefix, make):
    rt, mapper, address = opened_on(1, prefix, make)
    rt.current = 0  # the closing thread is current on another GPU
    mapper.close(address, 4096)
    assert rt.closed == [(address, 1)]
    assert rt.current == 0


@BOTH
def test_on_the_opening_device_nothing_is_switched(prefix, make):
    rt, mapper, address = opened_on(2, prefix, make)
    switches = []
    setattr(rt, f"{prefix}SetDevice", lambda ordinal: (switches.append(ordinal), (0,))[1])
    mapper.close(address, 4096)
    assert rt.closed == [(address, 2)] and switches == []
