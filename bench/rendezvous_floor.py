"""The rendezvous floor: what any brokered join costs on this machine, beside the seed's exchange and peerd.

    python bench/rendezvous_floor.py                          # host backend, N = 2, 8
    python bench/rendezvous_floor.py --backend cuda --ranks 2,8 --iters 60

N spawned workers sleep until one common instant, then exchange one 64-byte
handle each; a sample is the time from that instant until the slowest rank
holds every rank's. Paths, measured in the same run, alternating iteration
by iteration:

  gloo exchange    all_gather_object over a gloo group that is up: the seed's
                   exchange step alone (no allocation, no open, no agreement)
  zmq broker       a bare ZeroMQ ROUTER in a Python process of its own answers
                   every rank once all N sent (each answer carries the N
                   handles): a join through ZeroMQ with a broker that does no work
  zmtp client      the same ROUTER, its ranks speaking ZeroMQ's wire protocol
                   (ZMTP 3.0) themselves over a blocking Unix socket: the
                   broker's I/O thread kept, the ranks' left out
  unix broker      the same over AF_UNIX SOCK_SEQPACKET and select(): the floor
                   without ZeroMQ's I/O threads
  peerd next set   PeerBuffer(...) of a group the workers already hold a set of:
                   peerd's whole warm setup (join, views, commit), for scale

The brokers are the least a daemon-brokered join can cost with each
transport, which is what bounds issue 17's warm-setup target from below on a
given machine. Prints p50 / p90 in ms and the ratios to the gloo exchange;
writes the samples as JSON (bench/results/ by default).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import select
import socket
import struct
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

PATHS = ("gloo exchange", "zmq broker", "zmtp client", "unix broker", "peerd next set")
HANDLE = b"h" * 64


def zmq_broker(path: str, npes: int, rounds: int, ready) -> None:
    """Answer every rank with all N handles once all N sent theirs, ``rounds`` times."""
    import zmq

    sock = zmq.Context().socket(zmq.ROUTER)
    sock.bind(f"ipc://{path}")
    ready.set()
    for _ in range(rounds):
        got = [sock.recv_multipart() for _ in range(npes)]
        answer = b"".join(payload for _, payload in got)
        for identity, _ in got:
            sock.send_multipart([identity, answer])


class ZmtpDealer:
    """A DEALER speaking ZMTP 3.0 (NULL mechanism) itself over a blocking AF_UNIX socket: no I/O thread."""

    def __init__(self, path: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.sock.sendall(b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + bytes(32))
        greeting = self._exactly(64)
        assert greeting[0] == 0xFF and greeting[9] == 0x7F and greeting[10] == 3, greeting
        ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
        self.sock.sendall(b"\x04" + bytes([len(ready)]) + ready)
        flags, body = self._frame()
        assert flags & 4 and body.startswith(b"\x05READY"), body

    def _exactly(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("the ROUTER closed the connection")
            data += chunk
        return data

    def _frame(self) -> tuple[int, bytes]:
        flags = self._exactly(1)[0]
        size = struct.unpack(">Q", self._exactly(8))[0] if flags & 2 else self._exactly(1)[0]
        return flags, self._exactly(size)

    def send(self, payload: bytes) -> None:
        head = b"\x00" + bytes([len(payload)]) if len(payload) < 256 else b"\x02" + struct.pack(">Q", len(payload))
        self.sock.sendall(head + payload)

    def recv(self) -> bytes:
        while True:
            flags, body = self._frame()
            if not flags & 4:  # a command (a PING) is not a message
                assert not flags & 1, "one-frame messages only"
                return body


def unix_broker(path: str, npes: int, rounds: int, ready) -> None:
    """The same over SOCK_SEQPACKET: one connection per rank, select() until every rank sent."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(npes)
    ready.set()
    conns = [listener.accept()[0] for _ in range(npes)]
    for _ in range(rounds):
        got, waiting = [], set(conns)
        while waiting:
            readable, _, _ = select.select(list(waiting), [], [])
            for conn in readable:
                got.append(conn.recv(4096))
                waiting.discard(conn)
        answer = b"".join(got)
        for conn in conns:
            conn.send(answer)


def worker(rank, npes, args, start: C.Start, port, paths, results) -> None:
    try:
        import torch.distributed as dist
        import zmq

        from peerd_client import PeerBuffer

        device = C.torch_device(args.backend)
        C.init_gloo(port, rank, npes)
        dealer = zmq.Context().socket(zmq.DEALER)
        dealer.connect(f"ipc://{paths['zmq']}")
        zmtp = ZmtpDealer(paths["zmtp"])
        seq = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        seq.connect(paths["unix"])
        key = f"floor-{npes}"
        held = PeerBuffer(4096, key, rank, npes, device, name="held")  # the group is up: its page area mapped

        def zmq_join():
            dealer.send(HANDLE)
            assert len(dealer.recv()) == 64 * npes

        def zmtp_join():
            zmtp.send(HANDLE)
            assert len(zmtp.recv()) == 64 * npes

        def unix_join():
            seq.send(HANDLE)
            assert len(seq.recv(65536)) == 64 * npes

        def gloo_exchange():
            out = [None] * npes
            dist.all_gather_object(out, HANDLE)

        samples = {p: [] for p in PATHS}
        for i in range(args.warmup + args.iters):
            for path in (PATHS if i % 2 == 0 else PATHS[::-1]):
                buf = None
                instant, _ = start.wait(rank)
                if path == "peerd next set":
                    buf = PeerBuffer(args.nbytes, key, rank, npes, device, name=f"set-{i}")
                else:
                    {"gloo exchange": gloo_exchange, "zmq broker": zmq_join, "zmtp client": zmtp_join,
                     "unix broker": unix_join}[path]()
                elapsed = time.monotonic() - instant
                if i >= args.warmup:
                    samples[path].append(elapsed)
                start.barrier.wait()
                if buf is not None:
                    buf.close()
        held.close()
        dist.destroy_process_group()
        results.put((rank, samples, None))
    except BaseException:
        results.put((rank, {}, traceback.format_exc()))
        raise


def measure(npes: int, args) -> dict:
    ctx = mp.get_context("spawn")
    rounds = args.warmup + args.iters
    folder = tempfile.mkdtemp(prefix="floor-", dir="/tmp")
    paths = {name: os.path.join(folder, f"{name}.sock") for name in ("zmq", "zmtp", "unix")}
    brokers = []
    for target, path in ((zmq_broker, paths["zmq"]), (zmq_broker, paths["zmtp"]), (unix_broker, paths["unix"])):
        ready = ctx.Event()
        brokers.append(ctx.Process(target=target, args=(path, npes, rounds, ready), daemon=True))
        brokers[-1].start()
        if not ready.wait(30):
            raise RuntimeError(f"the {target.__name__} did not start")
    start = C.Start(ctx, npes, lead=args.lead)
    results = ctx.Queue()
    (port,) = C.free_ports(1)
    procs = [ctx.Process(target=worker, args=(r, npes, args, start, port, paths, results)) for r in range(npes)]
    for p in procs:
        p.start()
    per_rank = []
    for _ in range(npes):
        rank, samples, error = results.get(timeout=args.timeout)
        if error:
            for p in procs + brokers:
                p.kill()
            raise RuntimeError(f"N={npes} rank {rank} failed:\n{error}")
        per_rank.append(samples)
    for p in procs + brokers:
        p.join(30)
    for path in paths.values():
        os.unlink(path)
    os.rmdir(folder)
    out = {}
    for path in PATHS:
        slowest = [max(r[path][i] for r in per_rank) for i in range(args.iters)]
        out[path] = {**C.summary(slowest), "samples": slowest}
    return out


def main() -> None:
    parser = C.setup_parser(__doc__, ranks="2,8", iters=40, warmup=3, lead=0.02, timeout=600,
                            nbytes_help="bytes per rank of peerd's sets (default 2 MiB)")
    args = parser.parse_args()
    args.nbytes = args.nbytes or 2 * C.MiB

    info = {"bench": "rendezvous_floor", "machine": C.machine(), "backend": args.backend,
            "command": C.command_line(), "iters": args.iters, "by_n": {}}
    C.measure_each_n(f"rendezvous_floor-{args.backend}", info, args, measure)
    rows = []
    for n, r in info["by_n"].items():
        gloo = r["gloo exchange"]["p50"]
        rows.append([n] + [x for p in PATHS for x in (C.ms(r[p]["p50"]), C.ms(r[p]["p90"]))]
                    + [C.ratio(r[p]["p50"], gloo) for p in PATHS[1:]])
    header = ["N"] + [x for p in PATHS for x in (f"{p} p50", "p90")] + [f"{p} / gloo" for p in PATHS[1:]]
    print(f"\nrendezvous floor, ms from the common start until the slowest rank holds every handle "
          f"({args.backend} backend, {args.iters} iters; ratio = path / gloo exchange, p50)")
    print(C.table(header, rows))
    C.save(f"rendezvous_floor-{args.backend}", info, args.out)


if __name__ == "__main__":
    main()
