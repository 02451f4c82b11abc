"""Where the daemon's socket lives: one resolver for daemon, client and CLI.

Never an abstract-namespace path: it has no file permissions, so anyone on
the host could connect.
"""

from __future__ import annotations

import os


SYSTEM_SOCKET = "/run/peerd/peerd.sock"


def default_socket() -> str:
    """PEERD_SOCKET; else the system daemon's /run/peerd/peerd.sock for root, or for
    anyone once it exists (a worker running as a user finds the node's daemon);
    else the user's runtime dir; else /tmp."""
    explicit = os.environ.get("PEERD_SOCKET")
    if explicit:
        return explicit
    if os.geteuid() == 0 or something_at(SYSTEM_SOCKET):
        return SYSTEM_SOCKET
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return os.path.join(runtime, "peerd", "peerd.sock")
    return f"/tmp/peerd-{os.getuid()}/peerd.sock"


def something_at(path: str) -> bool:
    """Whether anything is at ``path``, counting a path this user may not look into (the node's socket
    directory, 0750): the daemon there is not this user's, which is no reason to look elsewhere (the
    client then says permission denied and names the group that may; selftest fails saying so)."""
    try:
        os.lstat(path)
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def check_socket_path(path: str) -> str:
    """The path, absolute; ValueError for what libzmq's ipc transport cannot use."""
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"the socket path must be a file path, not {path!r}")
    if path.startswith("@"):
        raise ValueError(f"{path!r} is an abstract-namespace socket; peerd needs a filesystem path")
    path = os.path.abspath(path)
    if len(fd_socket_path(path).encode()) > 107:  # sun_path is 108 bytes with its NUL
        raise ValueError(
            f"socket path {path!r} is longer than 104 bytes: a unix socket allows 107, and the daemon's "
            "fd channel lives beside it at PATH.fd; choose a shorter path"
        )
    return path


def endpoint(path: str) -> str:
    return f"ipc://{path}"


def fd_socket_path(socket_path: str) -> str:
    """The fd channel (peerd.fdchannel), beside the daemon's socket."""
    return socket_path + ".fd"


def lock_path(socket_path: str) -> str:
    return socket_path + ".lock"
