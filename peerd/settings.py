"""The daemon's settings: each declared once, then read from four places.

``OPTIONS`` is the one list. Every option is a command-line flag
(``--max-groups``), an environment variable (``PEERD_MAX_GROUPS``) and a key of
the configuration file (``max_groups``, in /etc/peerd/peerd.toml unless
``--config`` or ``PEERD_CONFIG`` names another). The command line wins over
the environment, which wins over the file, which wins over the default;
``peerd config`` shows the value of each and where it came from. A bad value
or an unknown key is an error at start-up naming the key and its source.
Sizes take binary or decimal suffixes ("64MiB", "16G"); "none" (or 0) means
no limit. Seconds are finite and at most MAX_TIMEOUT_S, the longest wait the
protocol carries. The file is read only if it is a regular file of at most
MAX_CONFIG_BYTES: SIGHUP reads it on the daemon's loop, which a FIFO or a
device in its place would block.
"""

from __future__ import annotations

import functools
import math
import os
import re
import stat
import sys
from dataclasses import dataclass, field, fields
from typing import Any, Callable

import click

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from .connections import (
    DEFAULT_CONNECTIONS_PER_UID,
    MAX_CONNECTIONS_CEILING,
    REFUSED_UID_CONNECTIONS,
    ConnectionLimits,
    default_max_connections,
)
from .access import group_setting, resolve_group
from .arena import ALIGNMENT, DEFAULT_CHUNK_BYTES, DEFAULT_IDLE_S
from .backends.arenas import ArenaSettings
from .liveness import MAX_PIDS_PER_UID
from .quotas import Limits
from .paths import check_socket_path, default_socket
from .protocol import DEFAULT_DEADLINE_S, MAX_TIMEOUT_S, is_wait

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


class ByteSize(click.ParamType):
    """A byte count: 4096, 64MiB, 16G; "none" or 0 for no limit, where the size is a limit."""

    name = "size"

    def __init__(self, limit: bool = True, multiple_of: int = 1):
        self.limit = limit  # False: a size the daemon carves by (a chunk), where 0 would mean nothing
        self.multiple_of = multiple_of

    def convert(self, value: Any, param, ctx) -> int:
        """Bytes; 0 stands for no limit (so "none" given on the command line is told from nothing given)."""
        example = "4096, 64MiB or 16GiB" + (" (or 'none')" if self.limit else "")
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            self.fail(f"{value!r} is not a size like {example}", param, ctx)
        if isinstance(value, int):
            size = value
        elif value.strip().lower() == "none":
            size = 0
        else:
            match = re.fullmatch(r"\s*(\d+)\s*([kmgt]i?)?b?\s*", value.lower())
            if not match:
                self.fail(f"{value!r} is not a size like {example}", param, ctx)
            size = int(match.group(1)) * _UNITS[match.group(2) or ""]
        if size < 0:
            self.fail(f"{value!r} is negative: give a size like {example}", param, ctx)
        if size == 0 and not self.limit:
            self.fail(f"{value!r} is no size here (this is not a limit): give one above 0, like {example}", param, ctx)
        if size % self.multiple_of:
            self.fail(f"{value!r} is not a multiple of {self.multiple_of} bytes", param, ctx)
        return size


class OctalMode(click.ParamType):
    """Permission bits written in octal, as chmod takes them: "0750".

    Only a string ("0750" or "0o750"): TOML reads an unquoted 750 as the decimal
    number (0o1356), and the number 0o750 cannot be told from it.
    """

    name = "mode"

    def convert(self, value: Any, param, ctx) -> int:
        if isinstance(value, int) and not isinstance(value, bool):  # 750 (decimal) or 0o750 alike: a number
            self.fail(f"{value!r} is a number, not a mode: give the mode as a quoted octal string, e.g. '0750'",
                      param, ctx)
        digits = value.strip().lower().removeprefix("0o") if isinstance(value, str) else ""
        if not re.fullmatch(r"[0-7]+", digits):
            self.fail(f"{value!r} is not an octal file mode like '0750'", param, ctx)
        mode = int(digits, 8)
        if mode > 0o777:
            self.fail(f"{value!r} is not a file mode between 0000 and 0777", param, ctx)
        if mode & (stat.S_IWGRP | stat.S_IWOTH):
            self.fail(f"{value!r} lets other users write to the socket's directory, who could replace the socket: "
                      "give a mode without group or other write, e.g. '0750'", param, ctx)
        return mode


class Seconds(click.ParamType):
    """A finite number of seconds up to the protocol's MAX_TIMEOUT_S.

    Longer, the daemon would hand joins a timeout the protocol refuses;
    inf overflows the drain's deadline and nan never reaches it.
    """

    name = "seconds"

    def __init__(self, zero: bool = False):
        self.zero = zero  # 0 means "at once" (an idle chunk freed, a drain skipped), not "never"

    def convert(self, value: Any, param, ctx) -> float:
        allowed = f"{'[' if self.zero else '('}0, {MAX_TIMEOUT_S:g}]"
        try:
            seconds = float(value) if not isinstance(value, bool) else math.nan
        except (TypeError, ValueError):
            seconds = math.nan
        if not is_wait(seconds, self.zero):
            self.fail(f"{value!r} is not a number of seconds in {allowed}", param, ctx)
        return seconds


class Integer(click.IntRange):
    """An integer in range; refuses the float or boolean click would truncate (1.5 is no uid, true no port)."""

    def convert(self, value: Any, param, ctx) -> int:
        if isinstance(value, (bool, float)):
            self.fail(f"{value!r} is not an integer", param, ctx)
        if isinstance(value, str):
            try:
                int(value)
            except ValueError:  # click's own words for this are "not a valid integer range"
                self.fail(f"{value!r} is not an integer", param, ctx)
        return super().convert(value, param, ctx)


class GroupName(click.ParamType):
    """A group name or gid, as text or a non-negative integer; a float or boolean names no group."""

    name = "group"

    def convert(self, value: Any, param, ctx) -> str:
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return str(value)
        if not isinstance(value, str) or not value.strip():
            self.fail(f"{value!r} is not a group name or gid", param, ctx)
        return value


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


_SECONDS = Seconds()
DEFAULT_CONFIG = "/etc/peerd/peerd.toml"
#: largest configuration file read; a bigger one is refused, not read on the daemon's loop
MAX_CONFIG_BYTES = 1 << 20
#: seconds SIGTERM waits for held buffers to be released
SHUTDOWN_GRACE_S = 30.0

OPTIONS = (
    Option("socket", str, default_socket, "Path of the daemon's unix socket "
           "[$PEERD_SOCKET, else /run/peerd/peerd.sock as root or where it exists, else $XDG_RUNTIME_DIR/peerd "
           "or /tmp/peerd-$UID]."),
    Option("backend", click.Choice(["auto", "host", "cuda", "hip"]), "auto",
           "Memory backend; auto picks cuda, else hip, else host shared memory."),
    Option("log_level", click.Choice(["debug", "info", "warning", "error"]), "info",
           "Logging threshold: info logs each set going live, failing and freed; debug adds each rank's join and release."),
    Option("rendezvous_timeout", _SECONDS, DEFAULT_DEADLINE_S, "Seconds a join waits for every rank, unless the client asks otherwise."),
    Option("agreement_timeout", _SECONDS, DEFAULT_DEADLINE_S, "Seconds an agreement waits for every vote, unless the client asks otherwise."),
    Option("socket_group", GroupName(), None,
           "Group (name or gid) given the socket and its directory; its members may connect."),
    Option("socket_dir_mode", OctalMode(), 0o750, "Mode of the socket's directory (never group- or world-writable)."),
    Option("allow_uid", Integer(min=0), (),
           "A uid allowed to call the daemon, besides root and the daemon's own (repeatable).", multiple=True),
    Option("allow_gid", GroupName(), (), "A group (name or gid) allowed to call the daemon (repeatable); when given, "
           "the socket group is no longer allowed by default.", multiple=True),
    Option("max_buffer_bytes", ByteSize(), Limits.max_buffer_bytes, "Largest single buffer."),
    Option("max_bytes_per_uid", ByteSize(), None, "Most bytes one uid may hold at once."),
    Option("max_bytes_per_device", ByteSize(), None, "Most bytes the daemon allocates on one device."),
    Option("arena_chunk_bytes", ByteSize(limit=False, multiple_of=ALIGNMENT), DEFAULT_CHUNK_BYTES,
           f"Size of the chunks each uid's buffers are carved from, per device (a multiple of {ALIGNMENT}); a "
           "bigger buffer gets an allocation of its own."),
    Option("arena_max_bytes_per_uid", ByteSize(), None, "Most bytes of chunks one uid may reserve, over all devices."),
    Option("arena_idle_s", Seconds(zero=True), DEFAULT_IDLE_S,
           "Seconds a chunk stays empty before it goes back to the driver."),
    Option("max_groups", Integer(min=1), Limits.max_groups, "Most buffer sets held at once."),
    Option("max_groups_per_uid", Integer(min=1), Limits.max_groups_per_uid,
           "Most buffer sets one uid may hold at once (its share of --max-groups)."),
    Option("max_ranks", Integer(min=1, max=1024), Limits.max_ranks, "Most ranks in one group."),
    Option("max_connections", Integer(min=1), default_max_connections, "Most client connections held at "
           f"once; more are shut down at once [default: what the hard fd limit carries, at most "
           f"{MAX_CONNECTIONS_CEILING}]."),
    Option("max_connections_per_uid", Integer(min=1), DEFAULT_CONNECTIONS_PER_UID,
           f"Most connections one uid may hold at once (a uid the allowlist refuses: {REFUSED_UID_CONNECTIONS})."),
    Option("max_processes_per_uid", Integer(min=1), MAX_PIDS_PER_UID,
           "Most live processes of one uid the daemon watches for their death at once (a pidfd each); past "
           "it, joins and votes of its new processes are refused until some exit."),
    Option("shutdown_grace", Seconds(zero=True), SHUTDOWN_GRACE_S,
           "Seconds SIGTERM waits for live groups to be released before freeing them anyway."),
    Option("metrics_port", Integer(min=0, max=65535), 0,
           "Serve Prometheus metrics on 127.0.0.1:PORT (0: off; needs prometheus-client)."),
    Option("control_pages", click.BOOL, True, "Give each live group a control page (tp_agree without a message, "
           "aborts that reach kernels); false: groups agree through the daemon's messages."),
)
_BY_NAME = {o.name: o for o in OPTIONS}


@dataclass(frozen=True)
class Settings:
    socket: str = field(default_factory=default_socket)
    backend: str = "auto"
    log_level: str = "info"
    rendezvous_timeout: float = DEFAULT_DEADLINE_S
    agreement_timeout: float = DEFAULT_DEADLINE_S
    socket_group: str | None = None
    socket_dir_mode: int = 0o750
    allow_uid: tuple[int, ...] = ()
    allow_gid: tuple[str, ...] = ()
    max_buffer_bytes: int | None = Limits.max_buffer_bytes
    max_bytes_per_uid: int | None = None  # None or 0: no limit
    max_bytes_per_device: int | None = None
    arena_chunk_bytes: int = DEFAULT_CHUNK_BYTES
    arena_max_bytes_per_uid: int | None = None  # None or 0: no limit
    arena_idle_s: float = DEFAULT_IDLE_S
    max_groups: int = Limits.max_groups
    max_ranks: int = Limits.max_ranks
    max_groups_per_uid: int = Limits.max_groups_per_uid
    max_connections: int = field(default_factory=default_max_connections)
    max_connections_per_uid: int = DEFAULT_CONNECTIONS_PER_UID
    max_processes_per_uid: int = MAX_PIDS_PER_UID
    shutdown_grace: float = SHUTDOWN_GRACE_S
    metrics_port: int = 0
    control_pages: bool = True

    @property
    def limits(self) -> Limits:
        return Limits(self.max_buffer_bytes or None, self.max_bytes_per_uid or None,
                      self.max_bytes_per_device or None, self.max_groups, self.max_ranks, self.max_groups_per_uid)

    @property
    def arena(self) -> ArenaSettings:
        return ArenaSettings(self.arena_chunk_bytes, self.arena_max_bytes_per_uid or None, self.arena_idle_s)

    @property
    def connection_limits(self) -> ConnectionLimits:
        return ConnectionLimits(self.max_connections, self.max_connections_per_uid)


class ConfigError(click.ClickException):
    """A bad configuration file or value; the message names the key and where it came from."""


def _env_name(name: str) -> str:
    return "PEERD_" + name.upper()


def _param_type(option: Option) -> click.ParamType:
    return option.type if isinstance(option.type, click.ParamType) else click.types.convert_type(option.type)


def _convert(option: Option, raw: Any, source: str) -> Any:
    items = raw if isinstance(raw, (list, tuple)) else [raw]
    if not option.multiple and isinstance(raw, (list, tuple)):
        raise ConfigError(f"{source}: {option.name} takes one value, not a list")
    if _param_type(option) is click.STRING and not all(isinstance(item, str) for item in items):  # click made 5 "5"
        raise ConfigError(f"{source}: {option.name} takes a string (in quotes), not {raw!r}")
    try:
        values = tuple(_param_type(option).convert(item, None, None) for item in items)
    except click.BadParameter as err:
        listing = " (a list's items are apart by commas)" if option.multiple and source.startswith("environment") else ""
        raise ConfigError(f"{source}: bad value for {option.name}: {err.message}{listing}") from None
    return values if option.multiple else values[0]


@dataclass
class Loader:
    """Resolves the settings from the command line, the environment, the file and the defaults.

    Kept by the daemon so that SIGHUP can read the file again with the same
    command line.
    """

    given: dict[str, Any]  # what the command line said (None or () where it said nothing)
    config: str | None = None  # --config
    default_file: str | None = DEFAULT_CONFIG  # read where nothing names a file (None: no file then)
    checks_socket: bool = True  # False: the command serves a socket of its own (`peerd run`)
    read_default: bool = field(default=False, init=False)  # the default file was there at a read: a reload
    # that finds it gone keeps the running settings, as for any file it cannot read

    def config_path(self) -> tuple[str | None, bool]:
        """The file to read, and whether someone asked for it explicitly."""
        explicit = self.config or os.environ.get("PEERD_CONFIG")
        return (explicit, True) if explicit else (self.default_file, False)

    def read_file(self) -> tuple[dict[str, Any], str | None]:
        path, explicit = self.config_path()
        if path is None:
            return {}, None
        try:
            text = _read_config(path)
        except OSError as err:
            if not explicit and not os.path.exists(path) and not self.read_default:  # the default file, absent
                return {}, None  # or out of this user's sight
            if not explicit and isinstance(err, FileNotFoundError):
                raise ConfigError(f"configuration file {path} was read before and is gone now: put it back, or "
                                  "restart the daemon to run without it") from None
            if isinstance(err, FileNotFoundError):
                raise ConfigError(f"configuration file {path} does not exist") from None
            raise ConfigError(f"cannot read configuration file {path}: {err.strerror or err}") from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"cannot read configuration file {path}: {err}") from None
        except RecursionError:
            raise ConfigError(f"cannot read configuration file {path}: its arrays or tables are nested too deeply "
                              "(peerd's settings nest none)") from None
        unknown = sorted(set(data) - set(_BY_NAME))
        if unknown:
            raise ConfigError(f"{path}: unknown key(s) {', '.join(unknown)}; known keys: {', '.join(_BY_NAME)}")
        self.read_default = self.read_default or not explicit
        return data, path

    def load(self) -> tuple["Settings", dict[str, str]]:
        """The settings, and where each value came from."""
        from_file, path = self.read_file()
        values, sources = {}, {}
        for option in OPTIONS:
            given, env = self.given.get(option.name), os.environ.get(_env_name(option.name))
            # a bad value in the environment or the file is refused even where something overrides it (an
            # empty variable overridden is as good as unset: templates leave them so)
            from_env = f"environment ({_env_name(option.name)})"
            overridden = given not in (None, ())
            in_env = (_convert(option, _listed(env) if option.multiple else env, from_env)
                      if env is not None and not (overridden and not env.strip()) else None)
            filed = option.name in from_file
            in_file = _convert(option, from_file[option.name], path) if filed else None
            if overridden:
                value, source = given, "command line"
            elif env is not None:
                value, source = in_env, from_env
            elif filed:
                value, source = in_file, path
            else:
                value = option.default() if callable(option.default) else option.default
                source = "default"
            values[option.name], sources[option.name] = value, source
        if self.checks_socket:  # absolute as read, so a reload compares the socket served with the same path
            try:
                values["socket"] = check_socket_path(values["socket"])
            except ValueError as err:
                raise ConfigError(f"{sources['socket']}: {err}") from None
        _check_groups(values, sources)
        return Settings(**values), sources


def _check_groups(values: dict[str, Any], sources: dict[str, str]) -> None:
    """A group name that names no group is refused with the other bad values, naming where it came from."""
    for name in ("socket_group", "allow_gid"):
        groups = values[name] if _BY_NAME[name].multiple else (values[name],)
        try:
            for group in groups:
                if group is not None:
                    resolve_group(group, group_setting(name))
        except ValueError as err:
            raise ConfigError(f"{sources[name]}: {err}") from None


def _listed(env: str) -> list[str]:
    """A repeatable option's environment value: items apart by commas (a group name may hold a space:
    "domain users")."""
    return [item.strip() for item in env.split(",") if item.strip()]


def _read_config(path: str) -> str:
    """The file's text; ConfigError unless it is a regular file of UTF-8, at most MAX_CONFIG_BYTES.

    Opened without blocking and checked before reading: SIGHUP reads it on
    the daemon's loop, where a FIFO (opened or read) or a device would stall
    every client.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(f"configuration file {path} is not a regular file: give the path of a TOML file")
        chunks, left = [], MAX_CONFIG_BYTES + 1
        while left and (chunk := os.read(fd, left)):
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"configuration file {path} is larger than {MAX_CONFIG_BYTES >> 20} MiB: peerd's settings "
                          "take a few lines; give the path of its TOML file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"configuration file {path} is not UTF-8 text (byte {err.start} is {data[err.start]:#04x}): "
                          "save it as UTF-8") from None


def serve_options(function: Callable | None = None, *, hidden: tuple[str, ...] = (),
                  node_file: bool = True) -> Callable:
    """Give a click command every daemon option and --config; it receives one ``settings``.

    The Loader is left in the click context's meta (key "peerd.loader") for
    commands that read the settings again (SIGHUP) or show their sources.
    ``hidden`` options are still parsed (so a command can refuse them with a
    reason) but left out of its --help. Without ``node_file`` the command
    reads DEFAULT_CONFIG only where --config or PEERD_CONFIG names it: it is
    the node service's (`peerd run`'s daemon is the job's own).
    """
    if function is None:
        return functools.partial(serve_options, hidden=hidden, node_file=node_file)

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        loader = Loader({o.name: kwargs.pop(o.name) for o in OPTIONS}, kwargs.pop("config"),
                        DEFAULT_CONFIG if node_file else None, checks_socket="socket" not in hidden)
        settings, _ = loader.load()
        click.get_current_context().meta["peerd.loader"] = loader
        return function(*args, settings=settings, **kwargs)

    for option in reversed(OPTIONS):
        default = "" if option.multiple or callable(option.default) else f" [default: {_shown(option)}]"
        wrapper = click.option(
            option.flag, option.name, type=option.type, default=() if option.multiple else None,
            multiple=option.multiple, help=f"{option.help}{default} [env: {_env_name(option.name)}]",
            hidden=option.name in hidden,
        )(wrapper)
    default_file = f"{DEFAULT_CONFIG} where it exists" if node_file else "none: the node's file is its service's"
    return click.option(
        "--config", "config", default=None, metavar="PATH",
        help=f"Configuration file [default: {default_file}] [env: PEERD_CONFIG]",
    )(wrapper)


def _shown(option: Option) -> str:
    if option.default is None or (isinstance(option.type, ByteSize) and not option.default):
        return "none"
    if isinstance(option.type, OctalMode):
        return f"{option.default:04o}"
    return str(option.default)


def settings_table(settings: "Settings", sources: dict[str, str]) -> list[tuple[str, str, str]]:
    """(key, value, source) for `peerd config`: a table to read, not a file to copy (none is a setting
    left unset, which TOML cannot write; modes are octal, sizes in bytes)."""
    rows = []
    for f in fields(settings):
        value = getattr(settings, f.name)
        shown = _shown(Option(f.name, _BY_NAME[f.name].type, value, "")) if not isinstance(value, tuple) else (
            "[" + ", ".join(map(str, value)) + "]")
        rows.append((f.name, shown, sources[f.name]))
    return rows
