"""Backends raise their own errors; the daemon's allocate alone turns them into protocol codes."""

from types import SimpleNamespace

import pytest

from peerd.backends import AllocationFailed, UnknownDevice, out_of_memory
from peerd.backends.host import Memory
from peerd.protocol import ErrorCode, ProtocolError
from peerd.server import Daemon


class Failing:
    def __init__(self, error: Exception):
        self.error = error

    def allocate(self, nbytes, device, flags, uid):
        raise self.error


def allocate_with(error: Exception) -> ProtocolError:
    with pytest.raises(ProtocolError) as caught:
        Daemon._allocate(SimpleNamespace(backend=Failing(error)), 4096, "GPU-1", 0, None)
    return caught.value


def test_the_host_backend_speaks_no_protocol():
    with pytest.raises(UnknownDevice, match="serves no device 'GPU-1'; it serves: host"):
        Memory().allocate_chunk(4096, "GPU-1", 0)


@pytest.mark.parametrize("error, code, message", [
    (UnknownDevice("serves no device 'GPU-1'"), ErrorCode.DEVICE_UNKNOWN, "serves no device 'GPU-1'"),
    (AllocationFailed("cannot export 4096 bytes"), ErrorCode.ALLOCATION_FAILED, "cannot export 4096 bytes"),
    (out_of_memory(4096, "GPU-1", "cudaErrorMemoryAllocation", 0), ErrorCode.ALLOCATION_FAILED,
     "cannot allocate 4096 bytes (4.0 KiB) on GPU-1: cudaErrorMemoryAllocation; 0 bytes (0 B) are free there"),
    (RuntimeError("driver gone"), ErrorCode.ALLOCATION_FAILED, "allocating 4096 bytes on GPU-1 failed: driver gone"),
])
def test_each_backend_error_becomes_one_code_with_its_message(error, code, message):
    refused = allocate_with(error)
    assert refused.code is code and refused.message == message
