"""Whether a socket path can be trusted: ssh's StrictModes, for the daemon's socket.

Whoever can replace a directory on the way to the socket, or the socket
itself, can put a daemon of their own there and collect what workers write
into the memory it hands out. So the daemon (for its socket directory's
ancestors) and the client (for the whole path) walk every component from /
down with lstat, never following anything, and accept a path only when:

- no component is a symlink (whoever owns the link chooses where it leads);
- every directory is owned by a trusted uid: root, the caller's own euid,
  or, for a client, the daemon's user (PEERD_DAEMON_USER, else the system
  user ``peerd`` where it exists, which the service runs as);
- no directory is writable by its group or others unless it is sticky
  (like /tmp, where nobody can rename or remove entries they do not own);
- the socket is a socket, owned by a trusted uid.

The client then checks the daemon's uid as the kernel reports it on the
hello reply (peerd_client.connection). Imported by the client: nothing here
may load the daemon's own modules.
"""

from __future__ import annotations

import grp
import os
import pwd
import socket
import stat
import struct
from collections.abc import Collection

import zmq

from .credentials import Credentials

DAEMON_USER_ENV = "PEERD_DAEMON_USER"
SYSTEM_DAEMON_USER = "peerd"  # systemd/peerd.sysusers creates it; peerd.service runs as it
DAEMON_USER_ADVICE = (f"If a daemon you trust runs as that user, name it in {DAEMON_USER_ENV} "
                      f"(default: the user {SYSTEM_DAEMON_USER}, where it exists).")


class SocketPathError(RuntimeError):
    """The socket path cannot be used; the message says why and what to do. ``code``: a stable name."""

    code = "UNTRUSTED_DAEMON"


class UntrustedPath(SocketPathError):
    """A component is a symlink, owned by an untrusted user, or writable by others."""


class NotASocket(SocketPathError):
    """The path names something other than a unix socket."""

    code = "NOT_A_SOCKET"


class AccessDenied(SocketPathError):
    """This user may not enter a directory on the way, or not connect to the socket."""

    code = "PERMISSION_DENIED"


_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a zombie still does, until its parent reaps it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


#: SO_PEERPIDFD (Linux 6.5), which Python's socket module does not name yet
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)


def peer_pidfd(sock: socket.socket, pid: int) -> int | None:
    """A pidfd on the process that made the connection ``sock``: the kernel's own (SO_PEERPIDFD), which
    stays that process's whatever its pid becomes, else pidfd_open of ``pid`` (a number reused since
    would fool it); None where neither works (the process is gone, or in another pid namespace)."""
    try:
        return sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError:
        pass
    if pid <= 0 or not hasattr(os, "pidfd_open"):
        return None
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


def peer_credentials(sock: socket.socket) -> Credentials:
    """The uid, gid and pid of the process that made the connection ``sock``, as the kernel recorded
    them (SO_PEERCRED); OSError where the socket cannot tell."""
    pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return Credentials(uid, gid, pid)


def credentials(frame: zmq.Frame) -> Credentials | None:
    """The uid, gid and pid of the process at the other end, as the kernel reported them (SO_PEERCRED).

    libzmq sets Peer-Address to "...:uid:gid:pid" on frames received over ipc,
    on either side: the daemon reads its callers off it, a client its daemon.
    Nothing a peer writes in its message is ever trusted for this.
    """
    try:
        address = frame.get("Peer-Address")
        uid, gid, pid = (int(part) for part in address.rsplit(":", 3)[1:])
    except (zmq.ZMQError, ValueError, AttributeError):
        return None
    return Credentials(uid, gid, pid)


def daemon_user() -> int | None:
    """The uid of the daemon's user: PEERD_DAEMON_USER (a name or uid), else the user peerd where it exists."""
    named = os.environ.get(DAEMON_USER_ENV, "").strip()
    if named.isdigit():
        return int(named)
    try:
        return pwd.getpwnam(named or SYSTEM_DAEMON_USER).pw_uid
    except KeyError:
        if named:
            raise UntrustedPath(f"{DAEMON_USER_ENV}={named!r} names no user: give the daemon's user name or uid")
        return None


def client_trusts() -> frozenset[int]:
    """The uids a client trusts to own its socket path and to be its daemon."""
    daemon = daemon_user()
    return frozenset({0, os.geteuid()} if daemon is None else {0, os.geteuid(), daemon})


def user_name(uid: int) -> str | None:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


def describe_uid(uid: int) -> str:
    name = user_name(uid)
    return f"uid {uid} ({name})" if name else f"uid {uid}"


def describe_gid(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return f"gid {gid}"


def describe_trusted(trusted: Collection[int]) -> str:
    return ", ".join(describe_uid(uid) for uid in sorted(trusted))


def check_directories(directory: str, trusted: Collection[int], advice: str = "") -> os.stat_result:
    """Refuse unless every component of the absolute ``directory``, / included, is a trusted directory.

    Returns the last one's lstat; FileNotFoundError when a component does not
    exist. ``advice`` ends the message about an untrusted owner.
    """
    current, info = "/", os.lstat("/")
    _check_directory(current, info, trusted, advice)
    for part in filter(None, directory.split("/")):
        current, info = os.path.join(current, part), _lstat(os.path.join(current, part), current, info)
        _check_directory(current, info, trusted, advice)
    return info


def check_socket(path: str, trusted: Collection[int]) -> None:
    """Refuse unless the absolute ``path`` is a socket this user may connect to, reached only through
    trusted directories and owned by a trusted uid. FileNotFoundError when nothing is there."""
    directory = os.path.dirname(path)
    info = _lstat(path, directory, check_directories(directory, trusted, DAEMON_USER_ADVICE))
    if stat.S_ISLNK(info.st_mode):
        raise UntrustedPath(_symlink(path))
    if not stat.S_ISSOCK(info.st_mode):
        raise NotASocket(
            f"{path} is not a socket but {kind(info.st_mode)}: point PEERD_SOCKET (or --socket) at the socket "
            "a peerd daemon serves, e.g. /run/peerd/peerd.sock"
        )
    if info.st_uid not in trusted:
        raise UntrustedPath(
            f"the socket {path} is owned by {describe_uid(info.st_uid)}, which this process does not trust "
            f"(trusted: {describe_trusted(trusted)}): whoever owns it may be serving a daemon of their own. "
            f"{DAEMON_USER_ADVICE}"
        )
    if not os.access(path, os.W_OK, effective_ids=os.access in os.supports_effective_ids):
        raise AccessDenied(_denied("connect to", path, info, stat.S_IWGRP))


def kind(mode: int) -> str:
    """What a file is, in words: 'a regular file', 'a directory', ..."""
    for test, name in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symlink"),
                       (stat.S_ISFIFO, "a fifo"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "an unknown kind of file"


def _lstat(path: str, parent: str, parent_info: os.stat_result) -> os.stat_result:
    try:
        return os.lstat(path)
    except PermissionError:
        raise AccessDenied(_denied("enter", parent, parent_info, stat.S_IXGRP) + f" (on the way to {path})") from None


def _denied(action: str, path: str, info: os.stat_result, group_bit: int) -> str:
    """This user may not do action on path: what was found there, and which group grants it."""
    mode, group, me = stat.S_IMODE(info.st_mode), describe_gid(info.st_gid), os.geteuid()
    found = (f"permission denied: {describe_uid(me)} may not {action} {path} (mode {mode:04o}, owner "
             f"{describe_uid(info.st_uid)}, group {group})")
    if mode & group_bit and info.st_gid == 0:  # no group of users: a daemon given no socket group
        return (f"{found}; only root's group may: ask the daemon's operator to give it a socket group of "
                "users (socket_group, --socket-group) that you are a member of")
    if mode & group_bit:
        return (f"{found}; members of group {group} may: ask to be added (usermod -aG {group} "
                f"{user_name(me) or 'USER'}, effective at the next login)")
    return f"{found}; only its owner may"


def _check_directory(path: str, info: os.stat_result, trusted: Collection[int], advice: str) -> None:
    mode = info.st_mode
    if stat.S_ISLNK(mode):
        raise UntrustedPath(_symlink(path))
    if not stat.S_ISDIR(mode):
        raise NotASocket(f"{path} is {kind(mode)}, not a directory: no socket can be under it")
    if info.st_uid not in trusted:
        raise UntrustedPath(
            f"{path} is owned by {describe_uid(info.st_uid)}, which this process does not trust (trusted: "
            f"{describe_trusted(trusted)}): that user could put a socket of their own in place of the daemon's; "
            f"use a socket whose every directory is owned by a trusted user. {advice}".rstrip()
        )
    if mode & (stat.S_IWGRP | stat.S_IWOTH) and not mode & stat.S_ISVTX:
        who = "everyone" if mode & stat.S_IWOTH else f"group {describe_gid(info.st_gid)}"
        raise UntrustedPath(
            f"{path} (mode {stat.S_IMODE(mode):04o}) is writable by {who} and not sticky: they could rename it "
            f"or put a socket of their own in place of the daemon's; remove that write access (chmod go-w {path})"
        )


def _symlink(path: str) -> str:
    return (f"{path} is a symlink (to {os.readlink(path)}), and peerd follows none in a socket path: whoever "
            f"owns a link chooses where it leads; give the resolved path ({os.path.realpath(path)}) instead, "
            "if you trust where it leads")
