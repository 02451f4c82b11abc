"""Who is calling, as the kernel reported it: the one argument every registry op takes for its caller.

Plain data with no imports, so the rules (peerd.registry) stay free of sockets: the daemon
reads these off each frame (peerd.trust.credentials) or the fd channel (SO_PEERCRED).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Credentials:
    uid: int
    gid: int
    pid: int
