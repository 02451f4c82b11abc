"""The `peerd` command: serve, and ask a running daemon how it is.

Exit codes of `status` and `ls`, for probes: 0 the daemon answered and is
healthy; 3 no daemon answered (the one-line reason goes to stderr). 2 stays
click's usage error.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import click

from . import __version__
from .paths import check_socket_path, default_socket

EXIT_UNREACHABLE = 3


def _setup_logging(level: str) -> None:
    # journald stamps every line itself; a terminal gets our own timestamps
    stamp = "" if os.environ.get("JOURNAL_STREAM") else "%(asctime)s "
    logging.basicConfig(level=level.upper(), format=stamp + "%(levelname)s %(name)s: %(message)s")


def _socket_option(function):
    return click.option(
        "--socket",
        "socket_path",
        default=default_socket,
        show_default="$PEERD_SOCKET, else /run/peerd/peerd.sock (root), $XDG_RUNTIME_DIR/peerd or /tmp/peerd-$UID",
        help="Path of the daemon's unix socket.",
    )(function)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="peerd")
def main() -> None:
    """peerd: peer-mapped device buffers for tensor-parallel workers on one node."""


@main.command()
@_socket_option
@click.option(
    "--backend",
    type=click.Choice(["auto", "host", "cuda", "hip"]),
    default="auto",
    show_default=True,
    help="Memory backend; auto picks cuda, else hip, else host shared memory.",
)
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info", show_default=True)
@click.option("--rendezvous-timeout", type=click.FloatRange(min=0, min_open=True), default=60.0, show_default=True,
              help="Seconds a join waits for every rank, unless the client asks otherwise.")
@click.option("--agreement-timeout", type=click.FloatRange(min=0, min_open=True), default=60.0, show_default=True,
              help="Seconds an agreement waits for every vote, unless the client asks otherwise.")
def serve(socket_path: str, backend: str, log_level: str, rendezvous_timeout: float, agreement_timeout: float) -> None:
    """Run the daemon in the foreground until SIGTERM or SIGINT."""
    from .backends import BackendUnavailable, memory_backend
    from .lockfile import AlreadyRunning
    from .server import Daemon

    _setup_logging(log_level)
    try:
        path = check_socket_path(socket_path)
        memory = memory_backend(backend)
        daemon = Daemon(path, memory, rendezvous_timeout, agreement_timeout)
        daemon.serve()
    except (AlreadyRunning, BackendUnavailable, ValueError, OSError) as err:
        raise click.ClickException(str(err)) from None


def _ask(socket_path: str, op: str) -> dict:
    """One request to the daemon; exits EXIT_UNREACHABLE when none answers."""
    from peerd_client.connection import Connection
    from peerd_client.errors import MonoUnsupported

    try:
        conn = Connection(socket_path)
        try:
            return conn.call(op, {})
        finally:
            conn.close()
    except (MonoUnsupported, ValueError) as err:
        click.echo(f"peerd: unreachable: {err}", err=True)
        sys.exit(EXIT_UNREACHABLE)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@main.command()
@_socket_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(socket_path: str, as_json: bool) -> None:
    """Is the daemon up, and what does it serve? Exit 0 if it answers, 3 if not."""
    info = _ask(socket_path, "status")
    if as_json:
        click.echo(json.dumps(info, indent=2, sort_keys=True))
        return
    click.echo(f"peerd {info['version']} (pid {info['pid']}) serving {info['socket']}: healthy")
    click.echo(
        f"backend {info['backend']}, up {info['uptime_s']:.0f}s, {info['groups']} buffer set(s), "
        f"{info['ranks_held']} rank(s) held, {_size(info['bytes_allocated'])} allocated, "
        f"client liveness by {info['liveness']}"
    )
    for d in info["devices"]:
        bus = f" {d['pci_bus_id']}" if d.get("pci_bus_id") else ""
        click.echo(
            f"  device {d['index']}: {d['uuid']}{bus} {d['name']}, {_size(d['total_bytes'])} total, "
            f"daemon footprint {_size(d['footprint_bytes']) if d['footprint_bytes'] is not None else 'unknown'}"
        )


@main.command(name="ls")
@_socket_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def list_groups(socket_path: str, as_json: bool) -> None:
    """Every buffer set the daemon holds: key, name, ranks, bytes, state, pids, age."""
    groups = _ask(socket_path, "ls")["groups"]
    if as_json:
        click.echo(json.dumps(groups, indent=2, sort_keys=True))
        return
    if not groups:
        click.echo("no buffer sets")
        return
    rows = [("GROUP", "NAME", "RANKS", "BYTES", "STATE", "PIDS", "AGE")]
    for g in groups:
        rows.append(
            (
                g["group"],
                g["name"],
                f"{len(g['joined'])}/{g['npes']}",
                _size(g["nbytes"]),
                g["state"] + (f" ({g['failure']})" if g["failure"] else ""),
                ",".join(str(p) for p in g["pids"].values()),
                f"{g['age_s']:.0f}s",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1])


@main.command()
@_socket_option
@click.option("--ranks", type=click.IntRange(1, 64), default=2, show_default=True, help="Worker processes to start.")
@click.option("--nbytes", type=click.IntRange(min=1), default=1 << 20, show_default=True, help="Bytes per rank.")
@click.option("--device", default=None, help="torch device for every rank (default: the GPU where torch sees one, else cpu).")
@click.option("--timeout", type=click.FloatRange(min=1), default=120.0, show_default=True, help="Seconds for the whole test.")
def selftest(socket_path: str, ranks: int, nbytes: int, device: str | None, timeout: float) -> None:
    """Start N workers that map, write, read and agree through the daemon; exit 0 only if all pass."""
    from .selftest import run_selftest

    sys.exit(run_selftest(socket_path, ranks, nbytes, device, timeout))
