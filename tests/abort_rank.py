"""One rank of the GPU abort tests: all-reduces that poll an inherited control page.

    python tests/abort_rank.py --rank R --npes N --group G [--page-fd FD] --role waiter|holder [--deadline S] [--graph]

Every rank builds a PeerBuffer of ``--group`` on cuda:0 and makes three
checked all-reduces polling an abort word: the page of ``--page-fd`` (the
one slot of its area), mapped for the GPU (peerd_client.hostmap.MappedArea
and MappedPage), where the test plays the
daemon; else the buffer's own control page, which the daemon aborts
(``buf.abort_source``; a ``--wired`` line reports its ``abort_address``). Then a ``holder`` prints {"holding": true} and sleeps (the test
kills it, stops it, or leaves it be); a ``waiter`` prints {"calling": true}
and calls once more (eagerly, or replaying a CUDA graph captured before
with ``--graph``), which can only end by the abort or the deadline. The
waiter then shows its CUDA context still works: a plain kernel, a new
allocation, and a new PeerBuffer of the waiters (group ``G-after``, ranks
0..waiters-1) whose all-reduce gives the right sum. Prints a JSON line.
"""

from __future__ import annotations

import argparse
import json
import time


def say(**fields) -> None:
    print(json.dumps(fields), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--npes", type=int, required=True)
    parser.add_argument("--group", required=True)
    parser.add_argument("--page-fd", type=int, default=None, help="default: the buffer's own control page")
    parser.add_argument("--role", choices=["waiter", "holder"], required=True)
    parser.add_argument("--waiters", type=int, default=0, help="waiter ranks, which are 0..waiters-1")
    parser.add_argument("--deadline", type=float, default=None)
    parser.add_argument("--graph", action="store_true")
    args = parser.parse_args()

    import torch

    from peerd.pagearea import Area
    from peerd_client import PeerBuffer
    from peerd_client.allreduce import all_reduce, raise_for_status
    from peerd_client.hostmap import MappedArea, MappedPage

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    area = Area.attach(args.page_fd) if args.page_fd is not None else None
    page = area.page(0, args.npes) if area is not None else None
    mapped = MappedPage(page, MappedArea(area.address, area.size), device) if page is not None else None
    buf = PeerBuffer(1 << 20, args.group, args.rank, args.npes, device)
    if mapped is None:
        mapped = buf.abort_source
        say(wired=buf.abort_address)
    x = torch.full((4096,), float(args.rank + 1), device=device)
    total = args.npes * (args.npes + 1) / 2
    for _ in range(3):
        assert torch.all(all_reduce(buf, x, abort=mapped, deadline=args.deadline) == total)
    status = torch.zeros(1, dtype=torch.int32, device=device)
    graph = None
    if args.graph:
        out = torch.empty_like(x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            all_reduce(buf, x, out, abort=mapped, deadline=args.deadline, status=status)
        graph.replay()  # every rank replays once: one more call of the group
        raise_for_status(int(status.item()), buf, mapped, args.deadline)
        assert torch.all(out == total)
    if args.role == "holder":
        say(holding=True)
        while True:
            time.sleep(1)
    say(calling=True)
    try:
        if graph is not None:
            graph.replay()
            raise_for_status(int(status.item()), buf, mapped, args.deadline)
        else:
            all_reduce(buf, x, abort=mapped, deadline=args.deadline)
        raised = None
    except Exception as err:
        raised = {"type": type(err).__name__, "message": str(err)}
    after = {"kernel": float((torch.ones(1000, device=device) * 2).sum().item())}
    fresh = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    fresh.fill_(1)
    after["allocation"] = int(fresh[-1].item())
    again = PeerBuffer(1 << 20, f"{args.group}-after", args.rank, args.waiters, device)
    y = torch.ones(4096, device=device)
    after["sum"] = float(all_reduce(again, y)[0].item())
    again.close()
    say(raised=raised, after=after)


if __name__ == "__main__":
    main()
