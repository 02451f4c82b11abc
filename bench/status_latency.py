"""Round trips to an idle daemon: `peerd status`, and where a call's time goes.

    python bench/status_latency.py                    # host backend
    python bench/status_latency.py --backend cuda --iters 5000

On a freshly started, idle daemon, from one client process:

  raw hello        a bare ZeroMQ DEALER sending a msgpack "hello" and waiting for
                   the reply: the daemon's floor, no client library
  client hello     peerd_client's Connection.call("hello")
  client status    Connection.call("status"): what `peerd status --json` asks
  tp_agree npes=1  a one-rank agreement through the daemon (registry included)
  gloo all_reduce  all_reduce(MIN) on a one-rank gloo group (the seed's
                   agreement with no peer: its fixed cost)
  `peerd status`   the CLI as a subprocess (interpreter start + connect +
                   status + print), against `python -c pass`

p50 / p99 in microseconds (ms for the CLI), with the ratio to raw hello.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402


def timed(fn, iters: int, warmup: int = 200) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    clock = time.perf_counter
    for _ in range(iters):
        t0 = clock()
        fn()
        out.append(clock() - t0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["host", "cuda"], default="host")
    parser.add_argument("--iters", type=int, default=3000)
    parser.add_argument("--cli-iters", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    import zmq

    from peerd.paths import endpoint
    from peerd.protocol import decode_reply, encode_request
    from peerd.routingids import new_routing_id
    from peerd_client import tp_agree
    from peerd_client.connection import Connection

    info = {"bench": "status_latency", "machine": C.machine(), "backend": args.backend,
            "command": C.command_line(), "rows": {}}
    with C.Daemon(args.backend) as daemon:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, new_routing_id())
        sock.connect(endpoint(daemon.socket))
        ids = iter(range(1, 1 << 62))

        def raw_hello():
            sock.send(encode_request(next(ids), "hello", {}))
            decode_reply(sock.recv())

        conn = Connection(daemon.socket)
        C.init_gloo(C.free_ports(1)[0], 0, 1)
        flag = torch.ones(1, dtype=torch.int32)
        rows = {
            "raw hello": timed(raw_hello, args.iters),
            "client hello": timed(lambda: conn.call("hello", {}), args.iters),
            "client status": timed(lambda: conn.call("status", {}), args.iters),
            "tp_agree npes=1": timed(lambda: tp_agree(True, "status-bench", 0, 1), args.iters),
            "gloo all_reduce npes=1": timed(lambda: dist.all_reduce(flag, op=dist.ReduceOp.MIN), args.iters),
        }
        dist.destroy_process_group()
        env = {**os.environ, "PEERD_SOCKET": daemon.socket}
        cli = [sys.executable, "-m", "peerd", "status"]
        rows["`peerd status` (subprocess)"] = timed(
            lambda: subprocess.run(cli, env=env, check=True, capture_output=True), args.cli_iters, warmup=1)
        rows["`python -c pass` (subprocess)"] = timed(
            lambda: subprocess.run([sys.executable, "-c", "pass"], check=True), args.cli_iters, warmup=1)
        info["rss"] = daemon.rss()
        conn.close()
        sock.close(0)
        ctx.term()
        info["daemon_exit"] = daemon.stop()

    base = C.quantile(rows["raw hello"], 0.5)
    table = []
    for name, samples in rows.items():
        s = info["rows"][name] = C.summary(samples)
        unit, scale = ("ms", 1e3) if "subprocess" in name else ("us", 1e6)
        table.append([name, f"{s['p50'] * scale:.1f} {unit}", f"{s['p99'] * scale:.1f} {unit}",
                      f"{s['p50'] / base:.2f}"])
    print(f"\nround trips to an idle daemon ({args.backend} backend, {args.iters} calls; ratio = p50 / raw hello p50)")
    print(C.table(["call", "p50", "p99", "ratio"], table))
    C.save(f"status_latency-{args.backend}", info, args.out)


if __name__ == "__main__":
    main()
