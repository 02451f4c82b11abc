"""A reference one-shot all-reduce on a PeerBuffer: what the buffers are for.

    from peerd_client.allreduce import all_reduce, capacity
    buf = PeerBuffer(1 << 20, "tp-0", rank, npes, device)   # used for nothing else
    y = all_reduce(buf, x)          # the sum of x over every rank, on every rank

Every rank reads every peer's input straight from the peer's buffer through
``buf.addresses`` and sums it: one kernel (Triton, one CTA) on a GPU, the same
steps in torch on the CPU for the host backend, so CI runs the protocol
without a GPU. fp32 and bf16; the sum runs in fp32 in rank order, so every
rank gets bitwise the same result.

Layout of every rank's buffer (byte offsets; one int64 word is 8 bytes)::

    0                 epoch     calls this rank has completed; only this rank writes it
    8 * (1 + p)       flag[p]   the last call whose input rank p has put in its slot;
                                only rank p writes it, into every rank's buffer
    H + s * S         slot s    this rank's input of call e lives in slot e % 2
                                (s = 0, 1; H = 8 * (1 + npes) rounded up to 128,
                                S = (nbytes - H) / 2 rounded down to 128 = capacity)

A fresh buffer is zero-filled, which is the starting state: epoch 0, no flag
set. Call e (the same e on every rank, since every rank calls in the same
order) on rank r:

1. copy the input into its own slot e % 2;
2. write flag[r] = e into every rank's buffer, with a system-scope release
   (after a CTA barrier, so it covers every thread's copy);
3. wait until its own flag[p] >= e for every p, with system-scope acquires,
   then a CTA barrier;
4. sum slot e % 2 of every rank, through the peers' addresses, into the output;
5. epoch = e.

Why no rank reads unfinished data: flag[p] >= e in step 3 acquires rank p's
release in step 2, which follows p's copy of call e. Why no rank overwrites
data a peer has not read: rank r next writes slot e % 2 in call e + 2, after
its call e + 1 saw flag[p] >= e + 1 for every p; rank p publishes e + 1 only
in its call e + 1, after its call e (and its reads of r's slot) finished.
So no rank runs more than one call ahead of the slowest, the slot being read
is never the one being written, and a flag only grows, with one writer.

The epoch lives in the buffer, on the device, and the kernel advances it: a
call captured in a CUDA graph advances it on every replay, and Python holds no
count. So every rank must make the same calls (same numel, same dtype) in
the same order, eager or replayed, each ordered after the previous one on
that rank (one stream), and the buffer must serve nothing else.

Progress: a rank's kernel spins in step 3 until every peer reached step 2.
On separate GPUs that always happens. Processes sharing one GPU run in
separate contexts, which the GPU time-slices (without MPS): a spinning kernel
is preempted at the end of its slice and the peers get their turn, so it
completes, but a call costs about one slice per other rank (docs/allreduce.md):
a correctness vehicle, not the target topology. Where kernels of different
ranks do run at once (MPS), they must be co-resident: one CTA per rank keeps
that to npes CTAs, and work that fills every SM can delay a call. A rank that never
calls leaves its peers' kernels spinning, as in vLLM's custom all-reduce; the
host path raises TimeoutError instead, after which the buffer is unusable.
"""

from __future__ import annotations

import ctypes
import platform
import time
from dataclasses import dataclass

import torch

from peerd.protocol import DEFAULT_DEADLINE_S

try:
    import triton
    import triton.language as tl
except ImportError:  # the host backend needs no Triton
    triton = None

WORD = 8
ALIGN = 128
DTYPES = (torch.float32, torch.bfloat16)
BLOCK = 4096  # elements a CTA moves per step
NUM_WARPS = 16
HOST_POLL_S = 20e-6  # a waiting host rank sleeps, so ranks sharing few cores still progress


@dataclass(frozen=True)
class Layout:
    """Where the epoch, the flags and the two slots sit in every rank's buffer."""

    npes: int
    nbytes: int

    @property
    def header(self) -> int:
        return -(-WORD * (1 + self.npes) // ALIGN) * ALIGN

    @property
    def slot(self) -> int:
        return (self.nbytes - self.header) // 2 // ALIGN * ALIGN

    def flag(self, rank: int) -> int:
        return WORD * (1 + rank)

    def slot_at(self, epoch: int) -> int:
        return self.header + (epoch % 2) * self.slot


def capacity(buf) -> int:
    """Bytes one call can reduce on this buffer: a slot's size."""
    return Layout(buf.npes, buf.nbytes).slot


def all_reduce(buf, x: torch.Tensor, out: torch.Tensor | None = None, *, timeout: float = DEFAULT_DEADLINE_S) -> torch.Tensor:
    """Sum ``x`` over every rank of ``buf``'s group into ``out`` (a new tensor
    when None; ``out=x`` reduces in place) and return it.

    Collective: every rank calls it with the same numel and dtype. ``timeout``
    bounds the host backend's wait for a peer (TimeoutError); a GPU kernel
    waits as long as it takes.
    """
    layout = Layout(buf.npes, buf.nbytes)
    out = torch.empty_like(x) if out is None else out
    if x.dtype not in DTYPES:
        raise TypeError(f"all_reduce sums {' or '.join(map(str, DTYPES))}, not {x.dtype}")
    if x.device != buf.addresses.device:
        raise ValueError(f"x is on {x.device}, this buffer on {buf.addresses.device}")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous")
    if (out.shape, out.dtype, out.device) != (x.shape, x.dtype, x.device) or not out.is_contiguous():
        raise ValueError("out must be a contiguous tensor of x's shape, dtype and device")
    if x.numel() * x.element_size() > layout.slot:
        raise ValueError(
            f"{x.numel() * x.element_size()} bytes do not fit this buffer's slot of {layout.slot} bytes "
            f"(nbytes={buf.nbytes}, npes={buf.npes}): build a PeerBuffer of at least "
            f"{2 * x.numel() * x.element_size() + layout.header + 2 * ALIGN} bytes"
        )
    if x.numel() == 0:
        return out
    if x.device.type == "cpu":
        _host(buf, layout, x, out, timeout)
    else:
        with torch.cuda.device(x.device):
            _one_shot[(1,)](
                x, out, buf.addresses, buf.rank, x.numel(), layout.header, layout.slot,
                NPES=buf.npes, BLOCK=BLOCK, num_warps=NUM_WARPS,
            )
    return out


def _word(address: int) -> ctypes.c_int64:
    return ctypes.c_int64.from_address(address)


def _slot_view(address: int, layout: Layout, epoch: int, like: torch.Tensor) -> torch.Tensor:
    nbytes = like.numel() * like.element_size()
    start = address + layout.slot_at(epoch)
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(start), dtype=like.dtype)


def _host(buf, layout: Layout, x: torch.Tensor, out: torch.Tensor, timeout: float) -> None:
    """Steps 1-5 on host shared memory. On x86-64 (TSO) an aligned int64 store
    is a release and an aligned int64 load an acquire, system-wide; on other
    CPUs these plain accesses would not order the slots, so they are refused."""
    if platform.machine() not in ("x86_64", "AMD64"):
        raise NotImplementedError("the host all-reduce relies on x86-64 memory ordering")
    epoch = _word(buf.local).value + 1
    _slot_view(buf.local, layout, epoch, x).copy_(x.reshape(-1))
    for address in buf.pointers:
        _word(address + layout.flag(buf.rank)).value = epoch
    deadline = time.monotonic() + timeout
    for peer in range(buf.npes):
        flag = _word(buf.local + layout.flag(peer))
        while flag.value < epoch:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"rank {peer} of group={buf.group_key} name={buf.name} did not reach all_reduce "
                    f"call {epoch} within {timeout}s; this buffer can no longer be used"
                )
            time.sleep(HOST_POLL_S)
    total = torch.zeros(x.numel(), dtype=torch.float32)
    for address in buf.pointers:
        total += _slot_view(address, layout, epoch, x).float()
    out.view(-1).copy_(total)
    _word(buf.local).value = epoch


if triton is not None:

    @triton.jit(do_not_specialize=["rank"])
    def _one_shot(x_ptr, out_ptr, addresses_ptr, rank, n, header, slot, NPES: tl.constexpr, BLOCK: tl.constexpr):
        """Steps 1-5 of the module docstring, one CTA per rank. cudaMalloc'd buffers
        start 256-byte aligned and header and slot are multiples of 128: multiple_of
        says so, which lets Triton use 16-byte accesses through the addresses."""
        local = tl.load(addresses_ptr + rank)
        epoch_ptr = local.to(tl.pointer_type(tl.int64))
        epoch = tl.load(epoch_ptr) + 1
        parity = epoch % 2
        offsets = tl.arange(0, BLOCK)
        mine = tl.multiple_of((local + header + parity * slot).to(tl.pointer_type(x_ptr.dtype.element_ty)), 16)
        for start in range(0, n, BLOCK):
            mask = start + offsets < n
            tl.store(mine + start + offsets, tl.load(x_ptr + start + offsets, mask=mask), mask=mask)
        tl.debug_barrier()  # every thread's copy precedes the releases

        for peer in tl.static_range(NPES):
            flag = (tl.load(addresses_ptr + peer) + 8 * (1 + rank)).to(tl.pointer_type(tl.int64))  # Layout.flag
            tl.atomic_xchg(flag, epoch, sem="release", scope="sys")
        for peer in tl.static_range(NPES):
            flag = (local + 8 * (1 + peer)).to(tl.pointer_type(tl.int64))
            seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
            while seen < epoch:
                seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
        tl.debug_barrier()  # the acquires precede every thread's reads

        for start in range(0, n, BLOCK):
            mask = start + offsets < n
            total = tl.zeros([BLOCK], dtype=tl.float32)
            for peer in tl.static_range(NPES):
                base = tl.load(addresses_ptr + peer) + header + parity * slot
                theirs = tl.multiple_of(base.to(tl.pointer_type(x_ptr.dtype.element_ty)), 16)
                total += tl.load(theirs + start + offsets, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + start + offsets, total.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(epoch_ptr, epoch)
