"""Who may reach the daemon: file permissions on the socket, then an allowlist.

An IPC handle lets whoever holds it read and write that memory, so the daemon
hands handles only to processes entitled to them. Two layers:

1. The filesystem. The socket lives in a directory the daemon owns (0750 by
   default) and is itself 0660, both in the socket group when one is set, so
   only that group's members can even connect. The daemon refuses a directory
   that users other than its owner can write to, or whose path has a symlink
   or a directory another user owns (peerd.trust): whoever controls any of
   them can replace the socket with their own and collect every handle.
2. The allowlist, checked against the kernel's credentials (SO_PEERCRED) on
   every message: root, the daemon's own uid, the socket group, plus any uid
   or gid configured. A gid matches the caller's primary or supplementary
   groups, the supplementary ones as the kernel recorded them when the
   connection was made (SO_PEERGROUPS, read on the connection's own socket).
   Never /proc/PID: the pid recorded at connect may be another process's by
   the time a message arrives (a caller can hand its connection to a child
   and exit), so nothing about the caller is ever read from it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import grp
import logging
import os
import socket
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from .credentials import Credentials
from .trust import NotASocket, UntrustedPath, check_directories, describe_gid, describe_uid, kind, peer_credentials

log = logging.getLogger("peerd.access")


class UnsafeSocketDirectory(UntrustedPath):
    """The socket's directory would let other users take the socket over."""


def resolve_group(name_or_gid: str | int, setting: str) -> int:
    """A group name or number as a gid; ValueError naming it, and the ``setting`` it came from, when there
    is no such group."""
    if isinstance(name_or_gid, int) or str(name_or_gid).isdigit():
        return int(name_or_gid)
    try:
        return grp.getgrnam(name_or_gid).gr_gid
    except KeyError:
        raise ValueError(f"no such group {name_or_gid!r} ({setting})") from None


def group_setting(name: str) -> str:
    """How a group's error names the setting it came from: its file key and its option."""
    return f"{name}, --{name.replace('_', '-')}"


def resolve_groups(socket_group: str | int | None, allow_gid: tuple) -> tuple[int | None, tuple[int, ...]]:
    """The socket group's gid (None: none) and the allowed gids, each name looked up (NSS: it may be slow)."""
    socket_gid = resolve_group(socket_group, group_setting("socket_group")) if socket_group is not None else None
    return socket_gid, tuple(resolve_group(g, group_setting("allow_gid")) for g in allow_gid)


def prepare_socket_dir(directory: str, mode: int, gid: int | None) -> bool:
    """Create the socket's directory, or take an existing one as it is; refuse one others could control.
    Whether this call created it (the daemon removes it again at stop).

    Every ancestor must be a trusted directory (peerd.trust; trusted: root and
    this daemon's uid). Only a directory this call creates gets ``mode`` and
    ``gid``, set through a descriptor that cannot follow a symlink: changing
    an existing one could change whatever a planted link points at. An
    existing directory must already be the daemon's and writable by no one
    else. Group write counts too: any member of the group could replace the socket
    (``mode`` never has it: peerd.settings refuses such a --socket-dir-mode).
    """
    parent = os.path.dirname(directory)
    try:
        check_directories(parent, {0, os.geteuid()})
    except FileNotFoundError:
        raise FileNotFoundError(
            f"the socket directory's parent {parent} does not exist: create it (owned by root or uid "
            f"{os.geteuid()}, writable by no one else) or give another --socket"
        ) from None
    try:
        os.mkdir(directory, mode)
        created = True
    except FileExistsError:
        created = False
    except OSError as err:  # its parent is not this daemon's to write (EACCES), a read-only or virtual fs
        raise UnsafeSocketDirectory(
            f"cannot create the socket directory {directory}: {err.strerror}: give another --socket (or "
            f"PEERD_SOCKET) in a directory this daemon ({describe_uid(os.geteuid())}) may create, or create "
            "this one for it (owned by it, writable by no one else)"
        ) from None
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except PermissionError:
        raise UnsafeSocketDirectory(
            f"this daemon ({describe_uid(os.geteuid())}) may not enter the socket directory {directory}, which "
            "is not its own: give another --socket (or PEERD_SOCKET), or `peerd run` for a daemon of one job"
        ) from None
    except OSError as err:
        if err.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        found = os.lstat(directory).st_mode
        why = "peerd follows no symlink to its socket; " if stat.S_ISLNK(found) else ""
        raise UnsafeSocketDirectory(
            f"socket directory {directory} is {kind(found)}, not a directory: {why}give the real path of a "
            "directory as --socket's"
        ) from None
    try:
        _check_own_directory(directory, fd, created, mode, gid)
    finally:
        os.close(fd)
    return created


def _check_own_directory(directory: str, fd: int, created: bool, mode: int, gid: int | None) -> None:
    info = os.fstat(fd)
    if info.st_uid != os.geteuid():
        raise UnsafeSocketDirectory(
            f"socket directory {directory} is owned by {describe_uid(info.st_uid)}, not by this daemon (uid "
            f"{os.geteuid()}): another user could replace the socket; use a directory the daemon owns (--socket, or, "
            "for the default path, PEERD_SOCKET or XDG_RUNTIME_DIR: /tmp/peerd-$UID is the last default, and any "
            "user can make that name first)"
        )
    if created:
        os.fchmod(fd, mode)  # mkdir's mode went through the umask
        if gid is not None:
            if not mode & stat.S_IXGRP:
                log.warning("socket directory %s is made with mode %04o (--socket-dir-mode), which keeps the members "
                            "of the socket group %s out: give a mode with group search, e.g. 0750", directory, mode,
                            describe_gid(gid))
            try:
                os.fchown(fd, -1, gid)
            except OSError as err:  # EPERM; EINVAL: a gid this user namespace does not map
                with contextlib.suppress(OSError):
                    os.rmdir(directory)  # empty, and made by this start: the next one makes it again
                if isinstance(err, PermissionError):
                    raise group_refused(gid) from None
                raise
        return
    found = stat.S_IMODE(info.st_mode)
    if found != mode:
        log.info("socket directory %s exists with mode %04o: --socket-dir-mode %04o applies only to a directory "
                 "the daemon creates", directory, found, mode)
    if found & (stat.S_IWOTH | stat.S_IWGRP):
        shared = found & stat.S_ISVTX  # /tmp and its like: shared on purpose, never to be chmodded
        fix = "" if shared else f"chmod go-w {directory}, or "
        raise UnsafeSocketDirectory(
            f"socket directory {directory} (mode {found:04o}) is writable by other users, who could replace "
            f"the socket, and peerd changes no directory it did not create: {fix}give a --socket in a "
            f"directory that does not exist yet (e.g. {os.path.join(directory, 'peerd', 'peerd.sock')})"
        )
    if gid is not None and not (info.st_gid == gid and found & stat.S_IXGRP) and not found & stat.S_IXOTH:
        log.warning(
            "socket directory %s (mode %04o, group %s) keeps the members of the socket group %s out, and peerd "
            "changes no directory it did not create: give it that group with group search (chgrp %s %s; "
            "chmod g+x %s), or give a --socket in a directory that does not exist yet",
            directory, found, describe_gid(info.st_gid), describe_gid(gid), gid, directory, directory,
        )


def remove_stale_socket(path: str) -> None:
    """Unlink a socket a daemon that is gone left at path; refuse to touch anything else.

    Called with the lock held, so no live daemon serves that socket.
    """
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise NotASocket(
            f"{path} is {kind(info.st_mode)}, not a socket a stopped daemon left: peerd serve leaves it as "
            "it is; move it away, or give another --socket"
        )
    log.warning("removing stale socket %s left by a daemon that is gone", path)
    os.unlink(path)


def secure_socket(path: str, gid: int | None) -> None:
    """0660, in the socket group when there is one: for the socket this daemon has just bound."""
    if gid is not None:
        give_to_group(path, gid)
    os.chmod(path, 0o660)


def give_to_group(path: str, gid: int) -> None:
    """``path`` (never a symlink's target) into the socket group; group_refused where the kernel says EPERM."""
    try:
        os.chown(path, -1, gid, follow_symlinks=False)
    except PermissionError:
        raise group_refused(gid) from None


def group_refused(gid: int) -> UnsafeSocketDirectory:
    """The kernel's EPERM for a socket group this daemon may not give: what it lacks, and the ways out."""
    return UnsafeSocketDirectory(
        f"this daemon ({describe_uid(os.geteuid())}) may not give its socket to the socket group "
        f"{describe_gid(gid)} (--socket-group, socket_group): it is not a member and lacks CAP_CHOWN; add its "
        "user to that group, keep CAP_CHOWN, or give another socket group"
    )


#: SO_PEERGROUPS (Linux 4.13): the peer's supplementary groups as the kernel recorded them at connect.
#: Python's socket module lacks the name on some builds; its value is 59 on every Linux architecture.
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
#: what Python's getsockopt can read at once: 256 gids; more go through libc (NGROUPS_MAX is 65536)
_GROUPS_AT_ONCE = 1024
_NGROUPS_MAX = 65536

#: The caller's supplementary groups, read only when the allowlist needs them: a frozenset, or None when
#: they cannot be known (then no gid matches through them)
GroupSource = Callable[[], "frozenset[int] | None"]

_unsupported_logged = False


def peer_groups(sock: socket.socket) -> frozenset[int] | None:
    """The supplementary groups of the process that made the connection ``sock``, as the kernel recorded
    them then (SO_PEERGROUPS); None when they cannot be read (a kernel before 4.13: logged once)."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, _GROUPS_AT_ONCE)
    except OSError as err:
        if err.errno == errno.ERANGE:  # more than 256 groups
            return _many_peer_groups(sock.fileno())
        if err.errno in (errno.ENOPROTOOPT, errno.EINVAL, errno.EOPNOTSUPP):
            _log_unsupported(err)
        else:
            log.warning("cannot read the supplementary groups of a connection (SO_PEERGROUPS): %s", err)
        return None
    return frozenset(struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4]))


def _many_peer_groups(fd: int) -> frozenset[int] | None:
    buffer = (ctypes.c_uint32 * _NGROUPS_MAX)()
    size = ctypes.c_uint32(ctypes.sizeof(buffer))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.getsockopt(fd, socket.SOL_SOCKET, SO_PEERGROUPS, buffer, ctypes.byref(size)) != 0:
        log.warning("cannot read the supplementary groups of a connection (SO_PEERGROUPS): %s",
                    os.strerror(ctypes.get_errno()))
        return None
    return frozenset(buffer[: size.value // 4])


def _log_unsupported(err: OSError) -> None:
    global _unsupported_logged
    if not _unsupported_logged:
        _unsupported_logged = True
        log.error(
            "this kernel does not report a connection's supplementary groups (SO_PEERGROUPS, Linux 4.13: %s): "
            "a caller whose uid and primary group are not allowed is refused even where a supplementary group "
            "of its is (--allow-gid, the socket group); peerd never reads them from /proc instead, since the "
            "pid there may be another process's by then. Allow such users by uid (--allow-uid) or by primary "
            "group, or run a newer kernel", err.strerror,
        )


def connection_groups(frame: zmq.Frame, who: Credentials) -> frozenset[int] | None:
    """The supplementary groups the kernel recorded for the connection ``frame`` came in on; None when
    they cannot be known.

    libzmq names the connection's fd on each frame (ZMQ_SRCFD). By the time the loop reads the frame
    that connection may be gone and its fd number another's, so the groups count only when that fd is
    a stream socket whose SO_PEERCRED is the frame's own (pid, uid, gid) from Peer-Address: else the
    caller is unknown. Read on a dup, so libzmq closing its fd meanwhile cannot swap the socket between
    the two reads.
    """
    try:
        fd = frame.get(zmq.SRCFD)
        dup = os.dup(fd)
    except (zmq.ZMQError, OSError, AttributeError, TypeError) as err:
        log.debug("no source fd for a frame of pid %d: %s", who.pid, err)
        return None
    try:
        peer = socket.socket(fileno=dup)
    except OSError:  # no longer a socket
        os.close(dup)
        return None
    with peer:
        try:
            if peer.family != socket.AF_UNIX or peer.type != socket.SOCK_STREAM:
                return None
            now = peer_credentials(peer)
        except OSError:
            return None
        if now != who:
            log.debug("the fd of a frame of pid %d (uid %d) is now another connection's (pid %d, uid %d): "
                      "its groups are unknown", who.pid, who.uid, now.pid, now.uid)
            return None
        return peer_groups(peer)


@dataclass(frozen=True)
class Allowlist:
    uids: frozenset[int] = field(default_factory=frozenset)
    gids: frozenset[int] = field(default_factory=frozenset)

    @classmethod
    def build(cls, uids: tuple[int, ...], gids: tuple[int, ...], socket_gid: int | None) -> "Allowlist":
        """Root and the daemon's uid always; the socket group unless the gids are given explicitly."""
        group_default = () if gids or socket_gid is None else (socket_gid,)
        return cls(frozenset({0, os.geteuid(), *uids}), frozenset({*gids, *group_default}))

    def admits(self, uid: int, gid: int, groups: GroupSource) -> bool:
        """Whether the caller with this uid and primary gid may use the daemon; ``groups`` gives its
        supplementary groups as the kernel recorded them at connect, asked only when the uid and primary
        gid do not decide (an allowed caller costs no system call); groups it cannot know admit nobody."""
        if uid in self.uids or gid in self.gids:
            return True
        if not self.gids:
            return False
        found = groups()
        return found is not None and not self.gids.isdisjoint(found)

    def describe(self) -> str:
        return f"uids {sorted(self.uids)}, gids {sorted(self.gids)}"
