"""The control page in a GPU's address space, so kernels can poll its abort word.

    mapped = MappedPage(page, torch.device("cuda", 0))
    all_reduce(buf, x, abort=mapped)        # the kernel polls mapped.abort_address
    mapped.close()                          # before page.close()

The page's memory is registered with ``cudaHostRegister(Mapped | Portable)``
(``hipHostRegister`` on ROCm): pinned, visible to every context of the
process, at the device address ``cudaHostGetDevicePointer`` returns. A
kernel loads the abort word with system-scope acquire loads and sees the
daemon's plain CPU store without any call on the host (peerd_client.allreduce).

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

    def register(self, address: int, size: int) -> int:
        rt = self.rt
        self._check(rt, rt.cudaHostRegister(address, size, REGISTER_PORTABLE | REGISTER_MAPPED),
                    "cudaHostRegister of the control page")
        try:
            return int(self._check(rt, rt.cudaHostGetDevicePointer(address, 0), "cudaHostGetDevicePointer"))
        except Exception:
            rt.cudaHostUnregister(address)
            raise

    def unregister(self, address: int) -> None:
        self._check(self.rt, self.rt.cudaHostUnregister(address), "cudaHostUnregister of the control page")


class _Hip:
    """The same calls through hip-python (run over the CUDA-backed shim only, never on ROCm)."""

    def __init__(self) -> None:
        from peerd.backends.hip import _check, _Hip

        self.hip, self._check = _Hip(), _check

    def register(self, address: int, size: int) -> int:
        rt = self.hip.rt
        self._check(rt.hipHostRegister(address, size, REGISTER_PORTABLE | REGISTER_MAPPED),
                    "hipHostRegister of the control page")
        try:
            return int(self._check(rt.hipHostGetDevicePointer(address, 0), "hipHostGetDevicePointer"))
        except Exception:
            rt.hipHostUnregister(address)
            raise

    def unregister(self, address: int) -> None:
        self._check(self.hip.rt.hipHostUnregister(address), "hipHostUnregister of the control page")


class MappedPage:
    """``page`` registered for ``device``: ``abort_address`` is where a kernel
    on that device loads the abort word; ``check()`` raises the abort on the host."""

    def __init__(self, page: ControlPage, device) -> None:
        self.page = page
        self.device = torch.device(device)
        self._runtime = _Hip() if torch.version.hip else _Cuda()
        with torch.cuda.device(self.device):
            base = self._runtime.register(page.address, page.size)
        self.abort_address = base + OFF_ABORT
        self._registered = page.address

    def check(self) -> None:
        self.page.check()

    def close(self) -> None:
        """Unregister (the page itself stays mapped); no kernel may still poll it."""
        if self._registered:
            with torch.cuda.device(self.device):
                self._runtime.unregister(self._registered)
            self._registered = 0
