"""One rank of `peerd selftest`: the smoke test a user runs after installing.

    python -m peerd_client.selftest --group KEY --rank R --npes N [--nbytes B] [--device cpu|cuda]

Builds a PeerBuffer, writes rank+1 into its own buffer with a device
operation, reads every peer's buffer through ``addresses`` with a device
operation, agrees that every rank saw every peer, closes; prints one JSON
line of checks and timings (milliseconds).
"""

from __future__ import annotations

import argparse
import json
import time


def run(group: str, rank: int, npes: int, nbytes: int, device: str | None) -> dict:
    from peerd_client import PeerBuffer, tp_agree

    from .views import byte_view, require_torch, worker_device

    torch = require_torch()
    dev = worker_device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    times, checks = {}, {}

    start = time.perf_counter()
    buf = PeerBuffer(nbytes, group, rank, npes, dev)
    times["setup_ms"] = (time.perf_counter() - start) * 1e3
    checks["zero-filled"] = bool((buf.bytes == 0).all())

    start = time.perf_counter()
    buf.bytes.fill_(rank + 1)
    sync()
    times["write_ms"] = (time.perf_counter() - start) * 1e3
    checks["barrier"] = tp_agree(True, group)  # every rank has written

    start = time.perf_counter()
    seen = []
    for peer, address in enumerate(buf.addresses.tolist()):
        view = byte_view(address, nbytes, dev, owner=buf)  # a device read through the peer's mapping
        seen.append(bool((view == peer + 1).all()))
    sync()
    times["read_ms"] = (time.perf_counter() - start) * 1e3
    checks["read every peer"] = all(seen)

    start = time.perf_counter()
    checks["agreement"] = tp_agree(all(checks.values()), group)
    times["agree_ms"] = (time.perf_counter() - start) * 1e3

    start = time.perf_counter()
    buf.close()
    times["close_ms"] = (time.perf_counter() - start) * 1e3
    return {"rank": rank, "device": str(dev), "checks": checks, "times": times, "unreadable_peers": [
        p for p, ok in enumerate(seen) if not ok]}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m peerd_client.selftest")
    parser.add_argument("--group", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--npes", type=int, required=True)
    parser.add_argument("--nbytes", type=int, default=1 << 20)
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    try:
        out = run(args.group, args.rank, args.npes, args.nbytes, args.device)
    except Exception as err:
        out = {"rank": args.rank, "error": f"{type(err).__name__}: {err}"}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
