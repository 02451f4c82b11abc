"""Torch views of raw addresses: the only place peerd_client touches torch.

A view never owns its memory: PeerBuffer.close() unmaps it, after which the
view must not be used (PeerBuffer drops its own reference first).
"""

from __future__ import annotations

import ctypes

from peerd.backends import BackendUnavailable


def require_torch():
    try:
        import torch
    except ImportError:
        raise ImportError(
            "peerd_client needs torch for PeerBuffer's views (bytes, addresses): "
            "install it in this environment, e.g. `pip install torch`"
        ) from None
    return torch


def worker_device(device=None):
    """``device`` as a torch.device with its index: a bare "cuda" is the worker's current GPU, as torch
    reads it; None is that GPU where torch sees one, else the CPU (host backend)."""
    torch = require_torch()
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device, int) and not isinstance(device, bool):
        device = torch.device("cuda", device)  # an ordinal, as torch reads one, without asking torch for a GPU
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as err:  # a typo must not read as "no GPU here", which engines fall back on
        raise ValueError(f"device={device!r} is no torch device ({str(err).splitlines()[0]}): pass a "
                         "torch.device, 'cpu', 'cuda' or 'cuda:N'") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BackendUnavailable(f"torch sees no GPU here (torch.cuda.is_available() is False, torch "
                                 f"{torch.__version__}), so it cannot use {device}: pass device=torch.device('cpu')")
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def backend_for(device, served: str) -> str:
    """Which backend's mapper opens a torch device's handles, given the daemon's backend.

    A GPU device takes the daemon's GPU backend (cuda or hip): the handles
    are the daemon's, so its runtime must open them, whatever torch was built
    for. A daemon that serves no GPU (host) has none to give: said here, with
    what to do, rather than as whatever this process lacks to name its GPU.
    """
    if device.type == "cpu":
        return "host"
    if device.type == "cuda":
        if served == "host":
            raise BackendUnavailable(
                f"the daemon serves host memory (--backend host), no GPU memory for {device}: pass "
                "device=torch.device('cpu'), or run the daemon with --backend cuda (pip install cuda-bindings) "
                "or --backend hip on this node"
            )
        return served
    raise ValueError(f"peerd serves cpu and cuda devices, not {device}")


class _DeviceBytes:
    """``__cuda_array_interface__`` of nbytes bytes at a raw device address."""

    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
        }


def byte_view(address: int, nbytes: int, device, owner: object = None):
    """A torch uint8 tensor over nbytes at address on device that keeps ``owner`` (what maps the memory,
    if given) alive: the tensor holds the object it was made from, which holds ``owner``."""
    torch = require_torch()
    if device.type == "cpu":
        memory = (ctypes.c_uint8 * nbytes).from_address(address)
        memory.owner = owner
        return torch.frombuffer(memory, dtype=torch.uint8)
    memory = _DeviceBytes(address, nbytes)
    memory.owner = owner
    return torch.as_tensor(memory, device=device)
