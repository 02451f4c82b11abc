"""The `peerd` command: serve, and ask a running daemon how it is.

Exit codes of `status`, for probes: 0 the daemon answered and is healthy; 1
it answered but is degraded (a device unusable, a group stuck past its
timeouts, a limit nearly reached, draining: the problems are listed); 3 no
daemon answered, or it refused this caller (the one-line reason goes to
stderr). `ls` exits 0 or 3. 2 stays click's usage error.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from typing import Any, Iterator

import click

from . import __version__
from .admission import admins_of
from .arena import describe_usage
from .escape import EscapingFormatter, escape
from .logbudget import log_budget
from .paths import default_socket
from .settings import Settings, serve_options
from .sizes import human

EXIT_DEGRADED = 1
EXIT_UNREACHABLE = 3


def _setup_logging(level: str) -> None:
    # journald stamps every line itself; a terminal gets our own timestamps
    stamp = "" if os.environ.get("JOURNAL_STREAM") else "%(asctime)s "
    handler = logging.StreamHandler()
    handler.setFormatter(EscapingFormatter(stamp + "%(levelname)s %(name)s: %(message)s"))  # one record, one line
    handler.addFilter(log_budget)  # no caller makes the daemon log without bound
    logging.basicConfig(level=level.upper(), handlers=[handler])


def _socket_option(function):
    return click.option(
        "--socket",
        "socket_path",
        default=default_socket,
        show_default="$PEERD_SOCKET, else /run/peerd/peerd.sock (root, or where it exists), $XDG_RUNTIME_DIR/peerd or /tmp/peerd-$UID",
        help="Path of the daemon's unix socket.",
    )(function)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="peerd")
def main() -> None:
    """peerd: peer-mapped device buffers for tensor-parallel workers on one node."""


@main.command()
@serve_options
def serve(settings: Settings) -> None:
    """Run the daemon in the foreground until SIGTERM or SIGINT."""
    from .access import UnsafeSocketDirectory
    from .backends import BackendUnavailable, memory_backend
    from .lockfile import AlreadyRunning
    from .server import Daemon

    _setup_logging(settings.log_level)
    try:
        loader = click.get_current_context().meta["peerd.loader"]
        Daemon(settings, lambda: memory_backend(settings.backend, settings.arena), loader).serve()
    except (AlreadyRunning, BackendUnavailable, UnsafeSocketDirectory, ValueError, OSError, RuntimeError) as err:
        raise click.ClickException(str(err)) from None


class _LauncherCommand(click.Command):
    """`peerd run`: its own failures, bad options and settings included, exit EXIT_FAILED, never click's
    1 or 2, which a job's own exit status could be."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        with _exiting_failed():
            return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        with _exiting_failed():
            return super().invoke(ctx)


@contextlib.contextmanager
def _exiting_failed() -> Iterator[None]:
    from .launcher import EXIT_FAILED

    try:
        yield
    except click.ClickException as err:
        err.exit_code = EXIT_FAILED
        raise


@main.command(cls=_LauncherCommand, options_metavar="[SERVE OPTIONS] --",
              context_settings={"allow_interspersed_args": False})
@serve_options(hidden=("socket",), node_file=False)
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED, metavar="CMD [ARGS]...")
def run(settings: Settings, command: tuple[str, ...]) -> None:
    """Run CMD with a daemon of its own, started before it and stopped after it.

    The daemon serves a socket in a fresh 0700 directory, given to CMD as
    $PEERD_SOCKET; SIGINT, SIGTERM and SIGHUP sent to peerd run go on to CMD.
    Exits with CMD's status (128+N if signal N killed it), 125 if peerd run
    itself failed. Example: peerd run -- torchrun --nproc-per-node 8 serve.py
    """
    from .launcher import launch

    loader = click.get_current_context().meta["peerd.loader"]
    if loader.given["socket"] is not None:
        raise click.UsageError(
            "peerd run gives the job a private socket; drop --socket, or run a shared daemon "
            "with `peerd serve --socket PATH` and point PEERD_SOCKET at it"
        )
    sys.exit(launch(settings, loader, command))


@main.command()
@serve_options
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def config(settings: Settings, as_json: bool) -> None:
    """Print the configuration `peerd serve` would run with, and where each value came from; it fails, as serve
    and a reload would, on any bad value (a group name that names no group too: peerd.settings)."""
    from .settings import settings_table

    loader = click.get_current_context().meta["peerd.loader"]
    rows = settings_table(settings, loader.load()[1])
    if as_json:
        click.echo(json.dumps({key: {"value": value, "source": source} for key, value, source in rows}, indent=2))
        return
    width = max(len(key) for key, _, _ in rows)
    value_width = max(len(value) for _, value, _ in rows)
    for key, value, source in rows:
        click.echo(f"{key.ljust(width)}  {value.ljust(value_width)}  # {source}")


def _connect(socket_path: str) -> Any:
    """A connection to the daemon; exits EXIT_UNREACHABLE when none answers, or when it refuses this
    caller's hello (not in its allowlist, another protocol version): either way no health can be read,
    which is what a probe must hear."""
    from peerd_client.connection import Connection
    from peerd_client.errors import DaemonUnavailable, MonoUnsupported

    try:
        return Connection(socket_path)
    except (DaemonUnavailable, ValueError) as err:
        click.echo(f"peerd: unreachable: {escape(str(err))}", err=True)
    except MonoUnsupported as err:
        click.echo(f"peerd: refused ({err.code}): {escape(str(err))}", err=True)
    sys.exit(EXIT_UNREACHABLE)


def _call(conn: Any, op: str, body: dict | None = None) -> dict:
    """One request; exits EXIT_UNREACHABLE when the daemon does not answer, 1 when it refuses."""
    from peerd_client.errors import DaemonUnavailable, MonoUnsupported

    try:
        return conn.call(op, body or {})
    except DaemonUnavailable as err:
        click.echo(f"peerd: unreachable: {escape(str(err))}", err=True)
        sys.exit(EXIT_UNREACHABLE)
    except MonoUnsupported as err:
        click.echo(f"peerd: {op} refused ({err.code}): {escape(str(err))}", err=True)
        sys.exit(1)


def _ask(socket_path: str, op: str, body: dict | None = None) -> dict:
    """One request on a connection of its own."""
    conn = _connect(socket_path)
    try:
        return _call(conn, op, body)
    finally:
        conn.close()


def _buffer_sets(conn: Any, after: list | None = None) -> Iterator[dict]:
    """Every buffer set after the cursor [group, name, uid, set], in that order, page by page (a page is one
    reply)."""
    while True:
        page = _call(conn, "ls", {"after": after})
        yield from page["groups"]
        if not page["more"] or not page["groups"]:
            return
        last = page["groups"][-1]
        after = [last["group"], last["name"], -1 if last["uid"] is None else last["uid"], last["set"]]


@main.command()
@_socket_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(socket_path: str, as_json: bool) -> None:
    """Is the daemon up, and how is it? Exit 0 healthy, 1 degraded, 3 unreachable."""
    info = _ask(socket_path, "status")
    code = EXIT_DEGRADED if info["health"] != "healthy" else 0
    if as_json:
        click.echo(json.dumps(info, indent=2, sort_keys=True))
        sys.exit(code)
    click.echo(f"peerd {info['version']} (pid {info['pid']}) serving {info['socket']}: {info['health']}"
               + (" (draining)" if info["draining"] else ""))
    for problem in info["problems"]:
        click.echo(f"  problem: {escape(problem)}")
    if info.get("restart_pending"):
        click.echo(f"  reloaded, but these settings take a restart: {', '.join(info['restart_pending'])}")
    click.echo(
        f"backend {info['backend']}, up {info['uptime_s']:.0f}s, {info['groups']} buffer set(s), "
        f"{info['ranks_held']} rank(s) held, {human(info['bytes_allocated'])} allocated, "
        f"client liveness by {info['liveness']}"
    )
    for d in info["devices"]:
        bus = f" {d['pci_bus_id']}" if d.get("pci_bus_id") else ""
        click.echo(
            f"  device {d['index']}: {d['uuid']}{bus} {d['name']}, {human(d['total_bytes'])} total, "
            f"daemon footprint {human(d['footprint_bytes']) if d['footprint_bytes'] is not None else 'unknown'}"
        )
        for line in describe_usage(d.get("arenas", [])):
            click.echo(f"    {line}")
    c = info["connections"]
    busiest = ", ".join(f"uid {uid}: {n}" for uid, n in c["top_uids"]) or "none"
    click.echo(
        f"connections: {c['open']} open of at most {c['max']} ({c['max_per_uid']} per uid), {c['refused']} shut "
        f"down over a cap, {info['replies_dropped']} repl(ies) dropped; busiest {busiest}"
    )
    sys.exit(code)


@main.command(name="ls")
@_socket_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def list_groups(socket_path: str, as_json: bool) -> None:
    """Every buffer set the daemon holds: key, name, owner uid, ranks, bytes, state, pids, age.

    Root and the daemon's user see every uid's sets; anyone else sees their own.
    """
    conn = _connect(socket_path)
    try:
        groups = list(_buffer_sets(conn))
        devices = _call(conn, "status")["devices"]
    finally:
        conn.close()
    if as_json:
        click.echo(json.dumps(groups, indent=2, sort_keys=True))
        return
    if not groups:
        click.echo("no buffer sets")
    else:
        _table(groups)
    for d in devices:  # what the sets are carved from: reserved against handed out, per device and uid
        for line in describe_usage(d.get("arenas", [])):
            click.echo(f"{d['uuid']}: {line}")


def _table(groups: list[dict]) -> None:
    """The buffer sets, one line each, a failure's reason on its own line below."""
    rows = [("GROUP", "NAME", "UID", "RANKS", "SIZE", "HELD", "STATE", "HOLDERS", "AGE")]
    for g in groups:
        rows.append(
            (
                escape(g["group"]),
                escape(g["name"]),
                str(g["uid"]),
                f"{len(g['joined'])}/{g['npes']}",
                human(g["nbytes"]),  # asked for per rank
                human(g["bytes_allocated"]),  # what the set holds now: 0 B once failed and freed
                g["state"],
                ",".join(str(g["pids"][str(r)]) for r in g["held"]) or "-",  # live holders, not the dead
                f"{g['age_s']:.0f}s",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for row, g in zip(rows, [None, *groups]):
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1])
        if g is not None and g["failure"]:
            click.echo(f"    why {g['state']}: {escape(g['failure'])}")


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


@main.command()
@_socket_option
@click.argument("group")
@click.option("--name", default=None, help="Only this buffer set of the group (default: all of them).")
@click.option("--uid", type=click.IntRange(min=0), default=None,
              help="Only the group of this uid's namespace (default: that group of every uid).")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def evict(socket_path: str, group: str, name: str | None, uid: int | None, yes: bool) -> None:
    """Free a stuck group's memory by force (root or the daemon's user only).

    Every user has a group namespace of its own: GROUP is evicted in each,
    unless --uid names one. Its holders are not asked: any kernel of theirs
    still polling the memory will touch freed memory. Use it for a group
    stuck behind processes that will not let go, after stopping them if you can.
    """
    conn = _connect(socket_path)
    try:
        if os.geteuid() not in admins_of(conn.daemon_uid):  # the daemon's own rule: say so before any warning
            click.echo(f"peerd: evict refused: only root or the daemon's user (uid {conn.daemon_uid}) may evict; "
                       f"uid {os.geteuid()} may not", err=True)
            sys.exit(1)
        sets = []
        for g in _buffer_sets(conn, after=[group, "", -2]):  # the group's sets come first, by name and uid
            if g["group"] != group:
                break
            if (name is None or g["name"] == name) and (uid is None or g["uid"] == uid):
                sets.append(g)
        if not sets:
            click.echo(f"peerd: no buffer set of group {escape(group)!r}" + (f" named {escape(name)!r}" if name else "")
                       + (f" of uid {uid}" if uid is not None else ""), err=True)
            sys.exit(1)
        for g in sets:
            pids = ", ".join(str(g["pids"][str(r)]) for r in g["held"]) or "none"
            click.echo(f"WARNING: group={escape(g['group'])} name={escape(g['name'])} of uid {g['uid']} "
                       f"({g['state']}) is held by pids {pids}; kernels of those processes may still touch its "
                       "memory after it is freed.", err=True)
        if not yes:
            try:
                click.confirm("Evict and free it now?", abort=True, err=True)
            except click.Abort:  # a no, Ctrl-C, or no terminal to ask on: click's bare "Aborted!" said none of it
                raise click.ClickException("nothing evicted: not confirmed (pass --yes to evict without asking)") \
                    from None
        for g in sets:  # one set per request: each reply stays small however many sets the group has
            for entry in _call(conn, "evict", {"group": group, "name": g["name"], "uid": g["uid"]})["evicted"]:
                click.echo(f"evicted group={escape(entry['group'])} name={escape(entry['name'])} of uid {entry['uid']}")
    finally:
        conn.close()
