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
   groups (read from /proc/PID/status, which the caller cannot forge).
"""

from __future__ import annotations

import errno
import grp
import logging
import os
import stat
from dataclasses import dataclass, field

from .trust import NotASocket, UntrustedPath, check_directories, describe_gid, describe_uid, kind

log = logging.getLogger("peerd.access")


class UnsafeSocketDirectory(UntrustedPath):
    """The socket's directory would let other users take the socket over."""


def resolve_group(name_or_gid: str | int) -> int:
    """A group name or number as a gid; ValueError naming it when there is no such group."""
    if isinstance(name_or_gid, int) or str(name_or_gid).isdigit():
        return int(name_or_gid)
    try:
        return grp.getgrnam(name_or_gid).gr_gid
    except KeyError:
        raise ValueError(f"no such group {name_or_gid!r} (for --socket-group / --allow-gid)") from None


def prepare_socket_dir(directory: str, mode: int, gid: int | None) -> None:
    """Create the socket's directory, or take an existing one as it is; refuse one others could control.

    Every ancestor must be a trusted directory (peerd.trust; trusted: root and
    this daemon's uid). Only a directory this call creates gets ``mode`` and
    ``gid``, set through a descriptor that cannot follow a symlink: changing
    an existing one could change whatever a planted link points at. An
    existing directory must already be the daemon's and writable by no one
    else. Group write counts too: any member of the group could replace the socket.
    """
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeSocketDirectory(
            f"socket directory mode {mode:04o} (--socket-dir-mode) is writable by other users, who could replace "
            "the socket; give a mode without group or other write, e.g. 0750"
        )
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
        raise UnsafeSocketDirectory(
            f"socket directory {directory} is {kind(os.lstat(directory).st_mode)}, not a directory: peerd "
            "follows no symlink to its socket; give the real path of a directory as --socket's"
        ) from None
    try:
        _check_own_directory(directory, fd, created, mode, gid)
    finally:
        os.close(fd)


def _check_own_directory(directory: str, fd: int, created: bool, mode: int, gid: int | None) -> None:
    info = os.fstat(fd)
    if info.st_uid != os.geteuid():
        raise UnsafeSocketDirectory(
            f"socket directory {directory} is owned by {describe_uid(info.st_uid)}, not by this daemon (uid "
            f"{os.geteuid()}): another user could replace the socket; use a directory the daemon owns"
        )
    if created:
        os.fchmod(fd, mode)  # mkdir's mode went through the umask
        if gid is not None:
            os.fchown(fd, -1, gid)
        return
    found = stat.S_IMODE(info.st_mode)
    if found & (stat.S_IWOTH | stat.S_IWGRP):
        raise UnsafeSocketDirectory(
            f"socket directory {directory} (mode {found:04o}) is writable by other users, who could replace "
            f"the socket, and peerd changes no directory it did not create: chmod go-w {directory}, or give "
            "a --socket in a directory that does not exist yet"
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
        os.chown(path, -1, gid, follow_symlinks=False)
    os.chmod(path, 0o660)


def supplementary_groups(pid: int) -> set[int]:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("Groups:"):
                    return {int(g) for g in line.split()[1:]}
    except OSError:
        pass
    return set()


@dataclass(frozen=True)
class Allowlist:
    uids: frozenset[int] = field(default_factory=frozenset)
    gids: frozenset[int] = field(default_factory=frozenset)

    @classmethod
    def build(cls, uids: tuple[int, ...], gids: tuple[int, ...], socket_gid: int | None) -> "Allowlist":
        """Root and the daemon's uid always; the socket group unless the gids are given explicitly."""
        group_default = () if gids or socket_gid is None else (socket_gid,)
        return cls(frozenset({0, os.geteuid(), *uids}), frozenset({*gids, *group_default}))

    def allows(self, uid: int, gid: int, pid: int) -> bool:
        if uid in self.uids or gid in self.gids:
            return True
        return bool(self.gids) and not self.gids.isdisjoint(supplementary_groups(pid))

    def describe(self) -> str:
        return f"uids {sorted(self.uids)}, gids {sorted(self.gids)}"
