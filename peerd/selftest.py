"""`peerd selftest`: N real worker processes against the running daemon.

The workers (peerd_client.selftest) need torch; this side only starts them
and renders what they report, so the daemon package stays torch-free.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import click

CHECKS = ("zero-filled", "barrier", "read every peer", "agreement")
TIMES = ("setup_ms", "write_ms", "read_ms", "agree_ms", "close_ms")


def _collect(proc: subprocess.Popen, rank: int, deadline: float) -> dict:
    try:
        out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"rank": rank, "error": "did not finish before the selftest's timeout"}
    for line in reversed(out.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (err.strip().splitlines() or ["no output"])[-1]
    return {"rank": rank, "error": f"exited {proc.returncode}: {tail}"}


def run_selftest(socket_path: str, ranks: int, nbytes: int, device: str | None, timeout: float) -> int:
    group = f"selftest-{uuid.uuid4().hex[:12]}"
    env = {**os.environ, "PEERD_SOCKET": socket_path}
    command = [sys.executable, "-m", "peerd_client.selftest", "--group", group, "--npes", str(ranks),
               "--nbytes", str(nbytes)] + (["--device", device] if device else [])
    started = time.monotonic()
    procs = [
        subprocess.Popen(command + ["--rank", str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for r in range(ranks)
    ]
    deadline = started + timeout
    results = [_collect(p, r, deadline) for r, p in enumerate(procs)]
    wall = time.monotonic() - started

    header = ["rank", "device", *CHECKS, *(t.removesuffix("_ms") + " ms" for t in TIMES)]
    rows = []
    passed = True
    for r in results:
        if "error" in r:
            passed = False
            rows.append([str(r["rank"]), "-", f"FAIL: {r['error']}"])
            continue
        ok = all(r["checks"].get(c) for c in CHECKS)
        passed &= ok
        rows.append(
            [str(r["rank"]), r["device"]]
            + ["pass" if r["checks"].get(c) else "FAIL" for c in CHECKS]
            + [f"{r['times'][t]:.2f}" for t in TIMES]
        )
    widths = [max(len(row[i]) for row in [header] + rows if i < len(row)) for i in range(len(header))]
    for row in [header] + rows:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))
    verdict = "PASS" if passed else "FAIL"
    click.echo(f"{verdict}: {ranks} rank(s), {nbytes} bytes each, group {group}, {wall:.2f}s wall")
    return 0 if passed else 1
