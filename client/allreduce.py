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
that to npes CTAs, and work that fills every SM can delay a call.

A rank that dies or stops (SIGSTOP) would leave its peers spinning in step 3
forever, as in vLLM's custom all-reduce. Two ways out, both optional (the
abort word also ends a wait on a rank stopped for PEERD_STOPPED_ABORT_S:
peerd_client.stoppedpeers):

``abort``: the group's abort word (a peerd.controlpage.ControlPage on the
    host; a peerd_client.hostmap.MappedPage, the same page mapped into the
    device's address space, on a GPU). By default the buffer's own
    (``buf.abort_source``, set up by PeerBuffer where the group has a
    control page); ``abort=None`` polls nothing. The kernel loads it with system-scope
    acquire loads before step 1 (an aborted group's memory may be freed: its
    kernel touches none) and in every spin of step 3, and the host twin
    checks it in every poll. On abort the call stops where it is and raises
    MonoUnsupported with the reason the daemon wrote. The word is read at
    run time, so a CUDA-graph replay honours an abort set after capture.
``deadline``: seconds a rank waits in step 3 (the GPU measures them with
    %globaltimer, in ns); then the call raises TimeoutError.

Either way the call ends without advancing the epoch, so the buffer can no
longer be used; the CUDA context stays usable. A GPU call reports how it
ended in ``status`` (int32: 0 done, 1 aborted, 2 timed out), which the host
reads after the kernel: eagerly that is a synchronization, so eager calls
given ``abort`` or ``deadline`` check it at once; under graph capture pass
your own ``status`` and call ``raise_for_status`` after a replay.
"""

from __future__ import annotations

import ctypes
import platform
import time
from dataclasses import dataclass

import torch

from peerd.controlpage import ControlPage, GroupAborted
from peerd.protocol import DEFAULT_DEADLINE_S

from .errors import MonoUnsupported

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
DONE, ABORTED, TIMED_OUT = 0, 1, 2  # the kernel's status
BUFFERS_PAGE = object()  # all_reduce's default abort: the buffer's control page, where its group has one


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


def all_reduce(buf, x: torch.Tensor, out: torch.Tensor | None = None, *, timeout: float = DEFAULT_DEADLINE_S,
               abort=BUFFERS_PAGE, deadline: float | None = None, status: torch.Tensor | None = None) -> torch.Tensor:
    """Sum ``x`` over every rank of ``buf``'s group into ``out`` (a new tensor
    when None; ``out=x`` reduces in place) and return it.

    Collective: every rank calls it with the same numel and dtype. ``timeout``
    bounds the host backend's wait for a peer (TimeoutError) where no
    ``deadline`` is given; a GPU kernel without ``deadline`` waits as long as
    it takes. ``abort``, ``deadline`` and ``status``: see the module docstring;
    by default ``abort`` is the buffer's own control page (``buf.abort_source``):
    the kernel polls it, and an eager call raises at its start once the group
    is aborted, without synchronizing; an ``abort`` passed explicitly also has
    every eager call read its status at once (a synchronization). None polls
    nothing.
    """
    addresses = buf.addresses
    if addresses is None:
        raise ValueError(f"this PeerBuffer (group={buf.group_key} name={buf.name}) is closed: build another")
    implicit = abort is BUFFERS_PAGE
    if implicit:
        abort = getattr(buf, "abort_source", None)
    layout = Layout(buf.npes, buf.nbytes)
    out = torch.empty_like(x) if out is None else out
    if x.dtype not in DTYPES:
        raise TypeError(f"all_reduce sums {' or '.join(map(str, DTYPES))}, not {x.dtype}")
    if x.device != addresses.device:
        raise ValueError(f"x is on {x.device}, this buffer on {addresses.device}")
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
        _host(buf, layout, x, out, timeout if deadline is None else deadline, abort)
        return out
    if isinstance(abort, ControlPage):
        raise TypeError("a kernel cannot read the control page at its host address: pass "
                        "peerd_client.hostmap.MappedPage(page, device) as abort")
    if implicit and abort is not None:
        _raise_if_aborted(abort)  # a host load: no synchronization, unlike checking the status below
    checked = status is None and (deadline is not None or (abort is not None and not implicit))
    if status is None:
        status = torch.empty(1, dtype=torch.int32, device=x.device)
    if deadline is not None and torch.version.hip:
        raise NotImplementedError("a kernel deadline needs %globaltimer (CUDA); on ROCm pass abort only")
    with torch.cuda.device(x.device):
        _one_shot[(1,)](
            x, out, addresses, status, buf.rank, x.numel(), layout.header, layout.slot,
            0 if abort is None else abort.abort_address, int((deadline or 0) * 1e9),
            NPES=buf.npes, BLOCK=BLOCK, HAS_ABORT=abort is not None, HAS_DEADLINE=deadline is not None,
            IS_HIP=bool(torch.version.hip), num_warps=NUM_WARPS,
        )
    if checked and not torch.cuda.is_current_stream_capturing():
        raise_for_status(int(status.item()), buf, abort, deadline)
    return out


def raise_for_status(code: int, buf, abort=None, deadline: float | None = None) -> None:
    """Raise what a call that ended with ``code`` (its status) means: MonoUnsupported
    with the abort's reason, or TimeoutError; nothing for a finished call."""
    if code == ABORTED:
        _raise_if_aborted(abort)
        raise MonoUnsupported(f"all_reduce on group={buf.group_key} name={buf.name} stopped: the group was "
                              f"aborted", "GROUP_FAILED")
    if code == TIMED_OUT:
        raise TimeoutError(
            f"a peer of rank {buf.rank} in group={buf.group_key} name={buf.name} did not reach all_reduce "
            f"within its deadline of {deadline}s; this buffer can no longer be used"
        )


def _raise_if_aborted(abort) -> None:
    try:
        abort.check()
    except GroupAborted as err:
        raise MonoUnsupported(f"all_reduce stopped: {err.reason}", "GROUP_FAILED") from None


def _word(address: int) -> ctypes.c_int64:
    return ctypes.c_int64.from_address(address)


def _slot_view(address: int, layout: Layout, epoch: int, like: torch.Tensor) -> torch.Tensor:
    nbytes = like.numel() * like.element_size()
    start = address + layout.slot_at(epoch)
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(start), dtype=like.dtype)


def _host(buf, layout: Layout, x: torch.Tensor, out: torch.Tensor, timeout: float, abort) -> None:
    """Steps 1-5 on host shared memory, checking ``abort`` as the kernel does.
    On x86-64 (TSO) an aligned int64 store is a release and an aligned int64
    load an acquire, system-wide; on other CPUs these plain accesses would
    not order the slots, so they are refused."""
    if platform.machine() not in ("x86_64", "AMD64"):
        raise NotImplementedError("the host all-reduce relies on x86-64 memory ordering")
    if abort is not None:
        _raise_if_aborted(abort)
    epoch = _word(buf.local).value + 1
    _slot_view(buf.local, layout, epoch, x).copy_(x.reshape(-1))
    for address in buf.pointers:
        _word(address + layout.flag(buf.rank)).value = epoch
    deadline = time.monotonic() + timeout
    for peer in range(buf.npes):
        flag = _word(buf.local + layout.flag(peer))
        while flag.value < epoch:
            if abort is not None:
                _raise_if_aborted(abort)
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

    @triton.jit
    def _abort_word(address, IS_HIP: tl.constexpr):
        """The abort word, loaded with a system-scope acquire: a CPU's store to the
        host page is seen without a cache in the way."""
        if IS_HIP:
            word = tl.atomic_add(address.to(tl.pointer_type(tl.int64)), 0, sem="acquire", scope="sys")
        else:
            word = tl.inline_asm_elementwise("ld.acquire.sys.global.u64 $0, [$1];", "=l,l", [address],
                                             dtype=tl.int64, is_pure=False, pack=1)
        return word

    @triton.jit
    def _globaltimer():
        """Nanoseconds of the GPU's global timer (PTX %globaltimer), as triton.language.extra.cuda reads it."""
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                         pack=1)

    @triton.jit(do_not_specialize=["rank", "abort_address", "deadline_ns"])
    def _one_shot(x_ptr, out_ptr, addresses_ptr, status_ptr, rank, n, header, slot, abort_address, deadline_ns,
                  NPES: tl.constexpr, BLOCK: tl.constexpr, HAS_ABORT: tl.constexpr, HAS_DEADLINE: tl.constexpr,
                  IS_HIP: tl.constexpr):
        """Steps 1-5 of the module docstring, one CTA per rank. cudaMalloc'd buffers
        start 256-byte aligned and header and slot are multiples of 128: multiple_of
        says so, which lets Triton use 16-byte accesses through the addresses.
        ``status`` gets DONE, ABORTED (before step 1 or while waiting in step 3) or
        TIMED_OUT (step 3 outlived deadline_ns); only DONE advances the epoch."""
        failed = tl.zeros((), dtype=tl.int32)
        if HAS_ABORT:
            failed = tl.where(_abort_word(abort_address, IS_HIP) != 0, 1, failed)  # ABORTED
        if HAS_DEADLINE:
            limit = _globaltimer() + deadline_ns
        if failed == 0:  # an aborted group's memory may be freed already: touch none of it
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
                while (seen < epoch) & (failed == 0):
                    seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
                    if HAS_ABORT:
                        failed = tl.where(_abort_word(abort_address, IS_HIP) != 0, 1, failed)
                    if HAS_DEADLINE:
                        failed = tl.where(_globaltimer() > limit, 2, failed)  # TIMED_OUT
            tl.debug_barrier()  # the acquires precede every thread's reads

            if failed == 0:
                for start in range(0, n, BLOCK):
                    mask = start + offsets < n
                    total = tl.zeros([BLOCK], dtype=tl.float32)
                    for peer in tl.static_range(NPES):
                        base = tl.load(addresses_ptr + peer) + header + parity * slot
                        theirs = tl.multiple_of(base.to(tl.pointer_type(x_ptr.dtype.element_ty)), 16)
                        total += tl.load(theirs + start + offsets, mask=mask, other=0.0).to(tl.float32)
                    tl.store(out_ptr + start + offsets, total.to(out_ptr.dtype.element_ty), mask=mask)
                tl.store(epoch_ptr, epoch)
        tl.store(status_ptr, failed)
