"""One rank of the all-reduce tests, run as its own process.

    python tests/allreduce_rank.py --rank R --npes N --group G [--device cpu|cuda] [--calls C] [--replays K]

Makes ``--calls`` eager all-reduces through every size from one element to
the buffer's capacity, fp32 and bf16, some in place, with random pauses so
the ranks drift apart; then, on a GPU, captures one call in a CUDA graph and
replays it ``--replays`` times, and makes eager calls again. Every rank
draws every rank's input from the same seeds, so it checks its result
against a plain sum (fp32, in rank order) bit for bit. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time


def start(daemon, npes: int, *args: str) -> list[subprocess.Popen]:
    """Every rank of a group, as processes against ``daemon`` (tests.conftest.Daemon)."""
    from tests.forkserver import popen

    return [
        popen([sys.executable, __file__, "--rank", str(r), "--npes", str(npes), *args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=daemon.env())
        for r in range(npes)
    ]


def inputs(call: int, npes: int, n: int, dtype, device):
    import torch

    g = torch.Generator().manual_seed(call)
    return [t.to(dtype).to(device) for t in torch.randn(npes, n, generator=g)]


def plain_sum(xs):
    import torch

    total = torch.zeros(xs[0].numel(), dtype=torch.float32, device=xs[0].device)
    for x in xs:
        total += x.float()
    return total.to(xs[0].dtype)


def sizes(cap_bytes: int, itemsize: int) -> list[int]:
    cap = cap_bytes // itemsize
    return sorted({n for n in (1, 2, 3, 31, 32, 33, 1000, 4096, 4097, cap // 3, cap - 1, cap) if 1 <= n <= cap})


def run(args) -> dict:
    import torch

    from peerd_client import PeerBuffer
    from peerd_client.allreduce import all_reduce, capacity

    torch.set_num_threads(1)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    pause = random.Random(args.rank)
    buf = PeerBuffer(args.nbytes, args.group, args.rank, args.npes, device)
    cap = capacity(buf)
    schedule = [(dtype, n) for dtype in (torch.float32, torch.bfloat16) for n in sizes(cap, dtype.itemsize)]
    failures, call, started = [], 0, time.monotonic()

    def check(out, xs, what):
        if not torch.equal(out, plain_sum(xs)):
            failures.append(f"call {call} ({what}, {xs[0].dtype}, n={xs[0].numel()}) differs from the plain sum")

    for i in range(args.calls):
        dtype, n = schedule[i % len(schedule)]
        xs = inputs(call, args.npes, n, dtype, device)
        if pause.random() < 0.3:
            time.sleep(pause.random() * 2e-3)
        mine = xs[args.rank].clone()
        out = all_reduce(buf, mine, out=mine if i % 3 == 0 else None)
        check(out, xs, "in place" if i % 3 == 0 else "eager")
        call += 1

    if args.replays:
        dtype, n = torch.bfloat16, 4096
        x = torch.empty(n, dtype=dtype, device=device)
        out = torch.empty_like(x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            all_reduce(buf, x, out)
        for _ in range(args.replays):
            xs = inputs(call, args.npes, n, dtype, device)
            x.copy_(xs[args.rank])
            graph.replay()
            check(out, xs, "graph replay")
            call += 1
        for dtype, n in schedule[-2:]:  # eager again: the device epoch kept count
            xs = inputs(call, args.npes, n, dtype, device)
            check(all_reduce(buf, xs[args.rank].clone()), xs, "eager after replays")
            call += 1

    epoch = int(buf.bytes[:8].view(torch.int64).item())  # the layout's epoch word
    seconds = time.monotonic() - started
    buf.close()
    return {"calls": call, "epoch": epoch, "capacity": cap, "seconds": seconds, "failures": failures[:10]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--npes", type=int, required=True)
    parser.add_argument("--group", required=True)
    parser.add_argument("--nbytes", type=int, default=1 << 16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--replays", type=int, default=0)
    args = parser.parse_args()
    try:
        out = {"ok": True, **run(args)}
    except Exception as err:
        out = {"ok": False, "type": type(err).__name__, "message": str(err)}
    print(json.dumps(out), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
