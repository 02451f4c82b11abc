"""The daemon's settings: each declared once, as a command-line option and a field.

``OPTIONS`` is the one list: ``peerd serve`` (and anything else that starts a
daemon) builds its click options from it, and ``Settings`` is what the daemon
receives. Sizes take binary or decimal suffixes ("64MiB", "16G"); "none" (or 0)
means no limit.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import click

from .groups import Limits
from .paths import default_socket
from .protocol import MAX_FRAME_BYTES

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


class ByteSize(click.ParamType):
    """A byte count: 4096, 64MiB, 16G; "none" or 0 for no limit."""

    name = "size"

    def convert(self, value: Any, param, ctx) -> int | None:
        if value is None or isinstance(value, int):
            return value or None
        match = re.fullmatch(r"\s*(\d+)\s*([kmgt]i?)?b?\s*", str(value).lower())
        if str(value).strip().lower() == "none":
            return None
        if not match:
            self.fail(f"{value!r} is not a size like 4096, 64MiB or 16G (or 'none')", param, ctx)
        return int(match.group(1)) * _UNITS[match.group(2) or ""] or None


class OctalMode(click.ParamType):
    name = "mode"

    def convert(self, value: Any, param, ctx) -> int:
        if isinstance(value, int):
            return value
        try:
            mode = int(str(value), 8)
        except ValueError:
            self.fail(f"{value!r} is not an octal file mode like 0750", param, ctx)
        if not 0 <= mode <= 0o777:
            self.fail(f"{value!r} is not a file mode between 0000 and 0777", param, ctx)
        return mode


@dataclass(frozen=True)
class Option:
    name: str  # the Settings field; --name-with-dashes on the command line
    type: Any
    default: Any
    help: str
    multiple: bool = False

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


_SECONDS = click.FloatRange(min=0, min_open=True)

OPTIONS = (
    Option("socket", str, default_socket, "Path of the daemon's unix socket "
           "[$PEERD_SOCKET, else /run/peerd/peerd.sock as root or where it exists, else $XDG_RUNTIME_DIR/peerd "
           "or /tmp/peerd-$UID]."),
    Option("backend", click.Choice(["auto", "host", "cuda", "hip"]), "auto",
           "Memory backend; auto picks cuda, else hip, else host shared memory."),
    Option("log_level", click.Choice(["debug", "info", "warning", "error"]), "info", "Logging threshold."),
    Option("rendezvous_timeout", _SECONDS, 60.0, "Seconds a join waits for every rank, unless the client asks otherwise."),
    Option("agreement_timeout", _SECONDS, 60.0, "Seconds an agreement waits for every vote, unless the client asks otherwise."),
    Option("socket_group", str, None, "Group (name or gid) given the socket and its directory; its members may connect."),
    Option("socket_dir_mode", OctalMode(), 0o750, "Mode of the socket's directory (never group- or world-writable)."),
    Option("allow_uid", int, (), "A uid allowed to call the daemon, besides root and the daemon's own (repeatable).",
           multiple=True),
    Option("allow_gid", str, (), "A group (name or gid) allowed to call the daemon (repeatable); when given, the "
           "socket group is no longer allowed by default.", multiple=True),
    Option("max_buffer_bytes", ByteSize(), Limits.max_buffer_bytes, "Largest single buffer."),
    Option("max_bytes_per_uid", ByteSize(), None, "Most bytes one uid may hold at once."),
    Option("max_bytes_per_device", ByteSize(), None, "Most bytes the daemon allocates on one device."),
    Option("max_groups", click.IntRange(min=1), Limits.max_groups, "Most buffer sets held at once."),
    Option("max_ranks", click.IntRange(min=1, max=1024), Limits.max_ranks, "Most ranks in one group."),
    Option("max_message_bytes", ByteSize(), MAX_FRAME_BYTES, "Largest request frame; bigger ones drop the connection."),
)


@dataclass(frozen=True)
class Settings:
    socket: str = field(default_factory=default_socket)
    backend: str = "auto"
    log_level: str = "info"
    rendezvous_timeout: float = 60.0
    agreement_timeout: float = 60.0
    socket_group: str | None = None
    socket_dir_mode: int = 0o750
    allow_uid: tuple[int, ...] = ()
    allow_gid: tuple[str, ...] = ()
    max_buffer_bytes: int | None = Limits.max_buffer_bytes
    max_bytes_per_uid: int | None = None
    max_bytes_per_device: int | None = None
    max_groups: int = Limits.max_groups
    max_ranks: int = Limits.max_ranks
    max_message_bytes: int = MAX_FRAME_BYTES

    @property
    def limits(self) -> Limits:
        return Limits(self.max_buffer_bytes, self.max_bytes_per_uid, self.max_bytes_per_device,
                      self.max_groups, self.max_ranks)


def serve_options(function: Callable) -> Callable:
    """Give a click command every daemon option; it receives them as one ``settings``."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        values = {o.name: kwargs.pop(o.name) for o in OPTIONS}
        values = {k: tuple(v) if isinstance(v, (list, tuple)) else v for k, v in values.items()}
        return function(*args, settings=Settings(**values), **kwargs)

    for option in reversed(OPTIONS):
        wrapper = click.option(
            option.flag, option.name, type=option.type, default=option.default, help=option.help,
            multiple=option.multiple, show_default=not callable(option.default) and not option.multiple,
        )(wrapper)
    return wrapper
