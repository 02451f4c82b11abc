"""A torchrun worker: the buffer set keyed by its torch ProcessGroup (seed 001's form).

    peerd run -- python -m torch.distributed.run --nproc-per-node 2 examples/torchrun_worker.py

torchrun starts the ranks and sets RANK, WORLD_SIZE and the rendezvous; peerd
needs nothing from the process group but rank, size and a store to agree on a
key, so a CPU-only gloo group is enough here. On GPUs, pass the tensor-parallel
group of the engine and the worker's CUDA device.
"""

import torch
import torch.distributed as dist

from peerd_client import PeerBuffer, tp_agree

dist.init_process_group("gloo")
group = dist.new_group(list(range(dist.get_world_size())), backend="gloo")
rank, npes = dist.get_rank(group), dist.get_world_size(group)

with PeerBuffer(1 << 16, group, device=torch.device("cpu"), name="kv") as buf:
    assert bool((buf.bytes == 0).all()), "every buffer starts zero-filled"
    buf.bytes[:8] = torch.arange(8, dtype=torch.uint8) + 10 * rank
    assert tp_agree(True, group)  # every rank has written
    print(f"rank {rank}/{npes}: addresses of every rank's buffer {buf.addresses.tolist()}", flush=True)
    assert tp_agree(True, group)  # every rank is done before any closes

dist.destroy_process_group()
