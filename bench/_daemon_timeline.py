"""``peerd serve`` with a timeline: ``python bench/_daemon_timeline.py OUT serve --backend ...``.

Why: a rank sees its join leave and its answer come back, and nothing of
what happened in between. This runs the daemon as ``python -m peerd`` would,
recording for every request it handles when the handling began and ended
and the CPU it took, and when each batch of replies had been sent, on
CLOCK_MONOTONIC, which the ranks' marks share. Written to OUT as JSON lines
when the daemon stops; setup_latency.py --timeline lines them up with the
ranks' joins. The records cost the daemon about a microsecond a request.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # peerd, as -m peerd finds it


def record(out_path: str) -> None:
    """Wrap the daemon's request handling and reply sending; write what they saw at shutdown."""
    from peerd import server

    rows: list[tuple] = []
    decoded: list = [None]
    real_decode, real_handle, real_deliver, real_shutdown = (
        server.decode_request, server.Daemon._handle, server.Daemon._deliver, server.Daemon.shutdown)

    def decode_request(frame):
        decoded[0] = request = real_decode(frame)
        return request

    def _handle(self, frames):
        decoded[0] = None
        began, cpu = time.monotonic(), time.thread_time()
        try:
            return real_handle(self, frames)
        finally:
            request = decoded[0]
            body = request.body if request is not None else {}
            rows.append(("handle", request.op if request is not None else None, body.get("group"),
                         body.get("name"), body.get("rank"), began, time.monotonic(), time.thread_time() - cpu))

    def _deliver(self, out):
        began = time.monotonic()
        real_deliver(self, out)
        if out:
            rows.append(("deliver", len(out), began, time.monotonic()))

    def shutdown(self, *args, **kwargs):
        try:
            return real_shutdown(self, *args, **kwargs)
        finally:
            with open(out_path, "w") as f:
                for row in rows:
                    f.write(json.dumps(row) + "\n")

    server.decode_request = decode_request
    server.Daemon._handle, server.Daemon._deliver, server.Daemon.shutdown = _handle, _deliver, shutdown


if __name__ == "__main__":
    record(sys.argv.pop(1))
    sys.argv[0] = "peerd"
    from peerd.cli import main

    main()
