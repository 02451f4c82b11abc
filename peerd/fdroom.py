"""The file descriptors the daemon may spend on its own objects, beside its connections.

libzmq aborts the whole daemon when its accept() meets EMFILE (peerd.connections), so
the fds the connection caps count on must stay free. Every other fd the daemon keeps
for a while, a pidfd per watched process (peerd.liveness), a memfd per control page
area (peerd.pages) and per host memory chunk (peerd.backends.host), an fd channel
connection kept open until its client reads the fds of its reply (peerd.fdchannel),
takes a place in this room first, and is refused, never opened, once the room is
full: a user who makes the daemon watch processes, open areas, make chunks or leave
replies unread cannot spend the fds its connections need. ``room_within`` sizes it
from the fd limit. A chunk's place is given back by the thread that closes its
memfd, so places are taken and given under a lock.
"""

from __future__ import annotations

import threading

from .connections import FDS_RESERVED, MONITOR_LAG

#: fds the room leaves to each connection the caps admit: its socket, the guard's pidfd on its opener
#: (peerd.connections), and a buffer fd on its way out
FDS_LEFT_PER_CONNECTION = 3
#: the room never shrinks below this, so a daemon under an fd limit too low for its connection caps
#: (it warns at start: peerd.connections) still serves a few processes
MIN_ROOM = 128


def room_within(fd_limit: int, max_connections: int) -> int:
    """The room an fd limit leaves beside the daemon's own fds, the guard's lag and the connections."""
    return max(MIN_ROOM, fd_limit - FDS_RESERVED - MONITOR_LAG - FDS_LEFT_PER_CONNECTION * max_connections)


class FdRoom:
    """Places for long-lived fds; ``size`` None: no limit (a registry without a daemon)."""

    def __init__(self, size: int | None = None) -> None:
        self.size = size
        self.used = 0
        self._lock = threading.Lock()

    @property
    def full(self) -> bool:
        return self.size is not None and self.used >= self.size

    def take(self, within: float = 1.0) -> bool:
        """One place, if the room is less than ``within`` (a share of it) full."""
        with self._lock:
            if self.size is not None and self.used >= self.size * within:
                return False
            self.used += 1
            return True

    def give(self) -> None:
        with self._lock:
            self.used -= 1

    def describe(self) -> str:
        return (f"the daemon holds {self.used} pidfds, control page areas, host memory chunks and unread fd "
                f"channel replies, of the {self.size} file descriptors its limit leaves beside its connections: "
                "raise its hard fd limit (LimitNOFILE= in the unit) or lower --max-connections")
