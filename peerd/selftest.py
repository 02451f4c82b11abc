"""`peerd selftest`: N real worker processes against a daemon.

The workers (peerd_client.selftest) need torch; this side only starts them
and renders what they report, so the daemon package stays torch-free. With
no daemon socket at the path, the test brings up a private one for its own run
(as `peerd run` does) and says so, so it works right after installing; a
socket whose daemon cannot be used (down, refusing this user) is a failure
with the reason, never a pass on another daemon.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import uuid

import click

from .ownpython import CHILD_CWD, python_child
from .paths import something_at

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
    """Run the workers on the daemon at socket_path, or on a private one if none answers; the exit code."""
    from .launcher import LaunchFailed, private_daemon

    if importlib.util.find_spec("torch") is None:
        click.echo(
            f"peerd selftest: FAIL: the workers need torch, which {sys.executable} cannot import: "
            "pip install torch (no GPU: pip install torch --index-url https://download.pytorch.org/whl/cpu)",
            err=True,
        )
        return 1
    socket_path = os.path.abspath(socket_path)  # the workers start in /
    if something_at(socket_path):  # a daemon's socket: test that daemon, or say why it cannot be tested
        refusal = _refusal(socket_path)
        if refusal:
            click.echo(f"peerd selftest: FAIL: {refusal}", err=True)
            return 1
        return _run_workers(socket_path, ranks, nbytes, device, timeout)
    click.echo(f"peerd selftest: no daemon socket at {socket_path}; testing on a private daemon started for this run")
    argv = lambda socket: ["--socket", socket, "--socket-dir-mode", "700", "--log-level", "warning"]  # noqa: E731
    try:
        with private_daemon(argv, stop_timeout=30) as daemon:
            return _run_workers(daemon.socket, ranks, nbytes, device, timeout)
    except LaunchFailed as err:
        click.echo(f"peerd selftest: FAIL: {err}", err=True)
        return 1


def _refusal(socket_path: str) -> str | None:
    """Why the daemon at socket_path cannot be tested by this user, or None: a node check must not pass on a
    private daemon while the node's own is down, or refuses this user."""
    from peerd_client.connection import Connection
    from peerd_client.errors import MonoUnsupported

    try:
        Connection(socket_path, connect_timeout=2.0).close()
    except MonoUnsupported as err:  # DaemonUnavailable too: no answer, an untrusted daemon, the allowlist
        return f"the daemon at {socket_path} cannot be used ({err.code}): {err}"
    return None


def _run_workers(socket_path: str, ranks: int, nbytes: int, device: str | None, timeout: float) -> int:
    group = f"selftest-{uuid.uuid4().hex[:12]}"
    command, env = python_child("peerd_client.selftest", "--group", group, "--npes", str(ranks), "--nbytes",
                                str(nbytes), *(["--device", device] if device else []),
                                env={**os.environ, "PEERD_SOCKET": socket_path})
    started = time.monotonic()
    procs = [
        subprocess.Popen(command + ["--rank", str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env, cwd=CHILD_CWD)
        for r in range(ranks)
    ]
    deadline = started + timeout
    results = [_collect(p, r, deadline) for r, p in enumerate(procs)]
    wall = time.monotonic() - started
    summary = f"{ranks} rank(s), {nbytes} bytes each, group {group}, {wall:.2f}s wall"
    errors = {r["error"] for r in results if "error" in r}
    if len(errors) == 1 and len(results) == sum("error" in r for r in results):
        click.echo(f"FAIL: every rank: {errors.pop()} ({summary})")
        return 1

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
    click.echo(f"{'PASS' if passed else 'FAIL'}: {summary}")
    return 0 if passed else 1
