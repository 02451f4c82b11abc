"""Two ranks on the host backend: map each other's buffer, read a peer, agree.

    peerd run -- python examples/two_ranks.py

This script plays both ranks itself (two processes); in an inference engine
each tensor-parallel worker runs the body of ``rank_main`` with its own rank.
The host backend serves CPU memory, so the device is ``torch.device("cpu")``;
on a GPU machine pass ``torch.device("cuda", local_rank)`` instead.
"""

import ctypes
import multiprocessing
import sys

import torch

from peerd_client import MonoUnsupported, PeerBuffer, tp_agree

GROUP, NPES, NBYTES = "example-two-ranks", 2, 4096


def peer_bytes(address: int, nbytes: int) -> torch.Tensor:
    """A CPU view of a peer's buffer through its address (what a kernel would read)."""
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)


def rank_main(rank: int) -> None:
    try:
        buf = PeerBuffer(NBYTES, GROUP, rank, NPES, torch.device("cpu"))
    except MonoUnsupported as err:  # every rank sees the same failure, with its cause
        sys.exit(f"rank {rank}: no peer memory ({err.code}): {err}")
    with buf:
        buf.bytes.fill_(rank + 1)  # write my own buffer
        assert tp_agree(True, GROUP), "a rank failed before writing"  # a barrier: every rank has written
        peer = (rank + 1) % NPES
        seen = int(peer_bytes(int(buf.addresses[peer]), NBYTES)[0])
        print(f"rank {rank}: peer {peer}'s buffer reads {seen}", flush=True)
        assert seen == peer + 1
        # one False vote makes the round False for every rank
        agreed = tp_agree(rank != 0, GROUP)
        print(f"rank {rank}: agreement with rank 0 voting False -> {agreed}", flush=True)
        assert agreed is False


if __name__ == "__main__":
    ranks = [multiprocessing.get_context("spawn").Process(target=rank_main, args=(r,)) for r in range(NPES)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join()
    sys.exit(max(p.exitcode for p in ranks))
