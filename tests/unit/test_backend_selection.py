"""Backend choice on a machine with no GPU library: "auto" must land on host.

The GPU libraries are hidden from import (a None entry in sys.modules makes
the import fail), so these tests mean the same on a machine that has
cuda-bindings or hip-python installed.
"""

import sys

import pytest

from peerd.backends import BACKENDS, BackendUnavailable, memory_backend
from peerd.backends import cuda, hip

NO_GPU_LIBRARIES = ("cuda", "cuda.bindings", "hip", "rocm", "rocm.bindings")


@pytest.fixture
def no_gpu_libraries(monkeypatch):
    for name in NO_GPU_LIBRARIES:
        monkeypatch.setitem(sys.modules, name, None)


def test_hip_without_hip_python_is_unavailable_and_says_what_is_missing(no_gpu_libraries):
    with pytest.raises(BackendUnavailable, match="hip-python / libamdhip64 could not be loaded"):
        hip.Memory()


def test_hip_mapper_without_hip_python_is_unavailable(no_gpu_libraries):
    with pytest.raises(BackendUnavailable, match="libamdhip64"):
        hip.Mapper()


def test_cuda_without_cuda_bindings_is_unavailable_and_says_how_to_install(no_gpu_libraries):
    with pytest.raises(BackendUnavailable, match="pip install cuda-bindings"):
        cuda.Memory()


def test_auto_falls_back_to_host_saying_why(no_gpu_libraries, caplog):
    """A GPU node whose daemon lacked cuda-bindings served host memory without a word on why."""
    caplog.set_level("INFO", logger="peerd.backends")
    backend = memory_backend("auto")
    assert backend.name == "host"
    assert [d["uuid"] for d in backend.devices()] == ["host"]
    assert "--backend auto serves host memory; passed over cuda: cuda-bindings is not importable" in caplog.text
    assert "; hip: hip-python / libamdhip64 could not be loaded" in caplog.text, caplog.text


def test_auto_tries_cuda_then_hip_then_host(monkeypatch):
    tried = []

    def unavailable(name):
        def make():
            tried.append(name)
            raise BackendUnavailable(f"{name}: not here")

        return make

    monkeypatch.setattr(cuda, "Memory", unavailable("cuda"))
    monkeypatch.setattr(hip, "Memory", unavailable("hip"))
    assert memory_backend("auto").name == "host"
    assert tried == ["cuda", "hip"]


def test_an_explicit_backend_that_is_unavailable_is_not_replaced(no_gpu_libraries):
    with pytest.raises(BackendUnavailable):
        memory_backend("cuda")


def test_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match="bogus") as caught:
        memory_backend("bogus")
    for choice in BACKENDS:
        assert choice in str(caught.value)
