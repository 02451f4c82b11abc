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

The HIP twin follows the same calls through hip-python: tests/gpu/test_hip.py
runs it through the real bindings over a CUDA-backed libamdhip64 (the
registration's flags, a device load of the abort word); no ROCm machine has
run it.
"""

from __future__ import annotations

import torch

from peerd.controlpage import OFF_ABORT, ControlPage

REGISTER_PORTABLE, REGISTER_MAPPED = 0x1, 0x2  # cudaHostRegister* and hipHostRegister* agree


class _Cuda:
    def __init__(self) -> None:
        from peerd.backends.cuda import _check, _load

        self.rt, self._check = _load(), _check

    def register(self, address: int, size: int) -> None:
        self._check(self.rt, self.rt.cudaHostRegister(address, size, REGISTER_PORTABLE | REGISTER_MAPPED),
                    "cudaHostRegister of the control page area")

    def device_pointer(self, address: int) -> int:
        """The registered ``address`` on the current device."""
        return int(self._check(self.rt, self.rt.cudaHostGetDevicePointer(address, 0), "cudaHostGetDevicePointer"))


class _Hip:
    """The same calls through hip-python (run over the CUDA-backed shim only, never on ROCm)."""

    def __init__(self) -> None:
        from peerd.backends.hip import _check, _Hip

        self.hip, self._check = _Hip(), _check

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
        self._registered = False
        self._bases: dict[int, int] = {}  # device index -> the area's address there

    def base(self, device) -> int:
        """The area's address for kernels on ``device``: registers the area the first time."""
        device = torch.device(device)
        base = self._bases.get(device.index)
        if base is None:
            with torch.cuda.device(device):
                if not self._registered:
                    self._runtime.register(self.address, self.size)
                    self._registered = True
                base = self._bases[device.index] = self._runtime.device_pointer(self.address)
        return base


class MappedPage:
    """``page`` of the registered ``area`` as kernels on ``device`` see it: ``abort_address`` is
    where they load the abort word; ``check()`` raises the abort on the host."""

    def __init__(self, page: ControlPage, area: MappedArea, device) -> None:
        self.page = page
        self.abort_address = area.base(device) + (page.address - area.address) + OFF_ABORT

    def check(self) -> None:
        self.page.check()
