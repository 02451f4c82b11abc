"""Control page areas in a GPU's address space, so kernels can poll a group's abort word.

    gpu = MappedArea(area.address, area.size)       # once per area, for the process's life
    mapped = MappedPage(page, gpu, torch.device("cuda", 0))
    all_reduce(buf, x, abort=mapped)                # the kernel polls mapped.abort_address

An area's memory is registered once with ``cudaHostRegister(Mapped |
Portable)`` (``hipHostRegister`` on ROCm): pinned and visible to every
context of the process; ``cudaHostGetDevicePointer`` gives its address on
each device the process uses (asked once per device), and a page's device
address is that base plus the page's offset in the area. A kernel loads the
abort word with system-scope acquire loads and sees the daemon's plain CPU
store without any call on the host (peerd_client.allreduce). The
registration is never undone: the area stays mapped for the process's life
(peerd_client.pagelink), and the next page in it costs no driver call.

On CUDA the registration waits for the first ``abort_address``, the
first all-reduce's: with eight processes on one GPU it costs 0.4-0.9 ms,
which a PeerBuffer's setup no longer pays, and which no process pays whose
kernels never poll the page. That first read is often inside a CUDA graph
capture (an engine captures its all-reduce), where the driver refuses a
registration in torch's default (global) capture mode and the capture
breaks, so the calling thread's capture mode is relaxed for the two calls
and restored after. hip-python's binding of
hipThreadExchangeStreamCaptureMode cannot set a mode (it only reads one
back), so on ROCm the area is registered when its first page is mapped, as
before, and never inside a capture.

The HIP twin follows the same calls through hip-python: tests/gpu/test_hip.py
runs it through the real bindings over a CUDA-backed libamdhip64 (the
registration's flags, a device load of the abort word); no ROCm machine has
run it.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import torch

from peerd.controlpage import OFF_ABORT, ControlPage

log = logging.getLogger("peerd_client")

REGISTER_PORTABLE, REGISTER_MAPPED = 0x1, 0x2  # cudaHostRegister* and hipHostRegister* agree


class _Cuda:
    registers_in_capture = True  # relaxed(): the calling thread may register inside a graph capture

    def __init__(self) -> None:
        from peerd.backends.cuda import _check, _load

        self.rt, self._check = _load(), _check

    @contextlib.contextmanager
    def relaxed(self):
        """This thread's calls neither fail nor break a graph any thread captures meanwhile."""
        relaxed = self.rt.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed
        before = self._check(self.rt, self.rt.cudaThreadExchangeStreamCaptureMode(relaxed),
                             "cudaThreadExchangeStreamCaptureMode")
        try:
            yield
        finally:
            self._check(self.rt, self.rt.cudaThreadExchangeStreamCaptureMode(before),
                        "cudaThreadExchangeStreamCaptureMode")

    def register(self, address: int, size: int) -> None:
        self._check(self.rt, self.rt.cudaHostRegister(address, size, REGISTER_PORTABLE | REGISTER_MAPPED),
                    "cudaHostRegister of the control page area")

    def device_pointer(self, address: int) -> int:
        """The registered ``address`` on the current device."""
        return int(self._check(self.rt, self.rt.cudaHostGetDevicePointer(address, 0), "cudaHostGetDevicePointer"))


class _Hip:
    """The same calls through hip-python (run over the CUDA-backed shim only, never on ROCm)."""

    registers_in_capture = False  # no mode can be set through hip-python: registered before any capture

    def __init__(self) -> None:
        from peerd.backends.hip import _check, _Hip

        self.hip, self._check = _Hip(), _check

    def relaxed(self):
        return contextlib.nullcontext()

    def register(self, address: int, size: int) -> None:
        self._check(self.hip.rt.hipHostRegister(address, size, REGISTER_PORTABLE | REGISTER_MAPPED),
                    "hipHostRegister of the control page area")

    def device_pointer(self, address: int) -> int:
        """The registered ``address`` on the current device."""
        return int(self._check(self.hip.rt.hipHostGetDevicePointer(address, 0), "hipHostGetDevicePointer"))


class MappedArea:
    """The area at host ``address`` (``size`` bytes), registered for the GPUs at its first ``base``."""

    def __init__(self, address: int, size: int) -> None:
        self.address, self.size = address, size
        self._runtime = _Hip() if torch.version.hip else _Cuda()
        self.registers_in_capture = self._runtime.registers_in_capture
        self._lock = threading.Lock()  # one thread registers; the others wait for its base
        self._registered = False
        self._bases: dict[int, int] = {}  # device index -> the area's address there

    def base(self, device) -> int:
        """The area's address for kernels on ``device``: registers the area the first time."""
        index = torch.device(device).index
        with self._lock:
            base = self._bases.get(index)
            if base is None:
                with torch.cuda.device(index), self._runtime.relaxed():
                    if not self._registered:
                        self._runtime.register(self.address, self.size)
                        self._registered = True
                    base = self._bases[index] = self._runtime.device_pointer(self.address)
        return base


class MappedPage:
    """``page`` of the registered ``area`` as kernels on ``device`` see it: ``abort_address`` is
    where they load the abort word (the area registered on the first read); ``check()`` raises the
    abort on the host."""

    def __init__(self, page: ControlPage, area: MappedArea, device) -> None:
        self.page, self._area, self._device = page, area, device
        self._abort_address = 0

    @property
    def abort_address(self) -> int:
        if not self._abort_address:
            base = self._area.base(self._device)
            self._abort_address = base + (self.page.address - self._area.address) + OFF_ABORT
        return self._abort_address

    def usable(self, label: str) -> bool:
        """Whether kernels can poll this page: False, with a WARNING, where the area's registration failed."""
        try:
            return bool(self.abort_address)
        except Exception as err:
            log.warning("%s: kernels cannot poll the control page's abort word, so a dead peer ends them only "
                        "at their deadline: registering its area with the GPU failed: %s: %s",
                        label, type(err).__name__, err)
            return False

    def check(self) -> None:
        self.page.check()
