"""Who may reach the daemon: file permissions on the socket, then an allowlist.

An IPC handle lets whoever holds it read and write that memory, so the daemon
hands handles only to processes entitled to them. Two layers:

1. The filesystem. The socket lives in a directory the daemon owns (0750 by
   default) and is itself 0660, both in the socket group when one is set, so
   only that group's members can even connect. The daemon refuses a directory
   that users other than its owner can write to: whoever can write there can
   replace the socket with their own and collect every handle.
2. The allowlist, checked against the kernel's credentials (SO_PEERCRED) on
   every message: root, the daemon's own uid, the socket group, plus any uid
   or gid configured. A gid matches the caller's primary or supplementary
   groups (read from /proc/PID/status, which the caller cannot forge).
"""

from __future__ import annotations

import grp
import os
import stat
from dataclasses import dataclass, field


class UnsafeSocketDirectory(RuntimeError):
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
    """Create or tighten the socket's directory; refuse one others could write to.

    Group write counts too: any member of the group could replace the socket.
    """
    os.makedirs(directory, mode=mode, exist_ok=True)
    info = os.stat(directory)
    if info.st_uid != os.geteuid():
        raise UnsafeSocketDirectory(
            f"socket directory {directory} is owned by uid {info.st_uid}, not by this daemon (uid "
            f"{os.geteuid()}): another user could replace the socket; use a directory the daemon owns"
        )
    os.chmod(directory, mode)
    if gid is not None:
        os.chown(directory, -1, gid)
    info = os.stat(directory)
    if info.st_mode & (stat.S_IWOTH | stat.S_IWGRP):
        raise UnsafeSocketDirectory(
            f"socket directory {directory} (mode {stat.S_IMODE(info.st_mode):04o}) is writable by other "
            "users, who could replace the socket; give it a mode without group or other write"
        )


def secure_socket(path: str, gid: int | None) -> None:
    """0660, in the socket group when there is one."""
    if gid is not None:
        os.chown(path, -1, gid)
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
