"""systemd's notify protocol, spoken directly: no libsystemd, no extra dependency.

Under ``Type=notify`` systemd waits for READY=1 before it starts units ordered
after peerd, shows the last STATUS= line in ``systemctl status``, restarts the
daemon when WATCHDOG=1 pings stop (``WatchdogSec=``), and knows a stop is
under way from STOPPING=1. Outside systemd (no NOTIFY_SOCKET) every call is
a no-op.
"""

from __future__ import annotations

import logging
import os
import socket
import time

log = logging.getLogger("peerd.notify")


class Notifier:
    def __init__(self, environ=os.environ):
        path = environ.get("NOTIFY_SOCKET")
        # "@name" is systemd's own abstract socket; peerd never binds one of its own
        self._address = ("\0" + path[1:]) if path and path.startswith("@") else path
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) if path else None
        usec, pid = environ.get("WATCHDOG_USEC"), environ.get("WATCHDOG_PID")
        ours = pid is None or pid == str(os.getpid())
        #: seconds between WATCHDOG=1 pings: half the watchdog timeout, as sd_watchdog_enabled advises
        self.watchdog_interval = _microseconds(usec) / 2e6 if usec and ours and self._socket else None
        self._last_status: str | None = None

    @property
    def active(self) -> bool:
        return self._socket is not None

    def _send(self, message: str) -> None:
        if self._socket is None:
            return
        try:
            self._socket.sendto(message.encode(), self._address)
        except OSError as err:  # systemd gone or socket full: never worth dying for
            log.warning("sd_notify %r failed: %s", message.split("\n", 1)[0], err)

    def ready(self, status: str) -> None:
        self._last_status = status
        self._send(f"READY=1\nSTATUS={status}\nMAINPID={os.getpid()}")

    def status(self, status: str) -> None:
        if status != self._last_status:
            self._last_status = status
            self._send(f"STATUS={status}")

    def watchdog(self) -> None:
        self._send("WATCHDOG=1")

    def stopping(self, status: str) -> None:
        self._last_status = status
        self._send(f"STOPPING=1\nSTATUS={status}")

    def reloading(self) -> None:
        # the clock reading tells systemd which reload this is (required from systemd 253 on)
        self._send(f"RELOADING=1\nMONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")

    def reloaded(self, status: str) -> None:
        self._last_status = status
        self._send(f"READY=1\nSTATUS={status}")

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def _microseconds(usec: str) -> int:
    """WATCHDOG_USEC, which names the watchdog's timeout this daemon must ping within."""
    try:
        return int(usec, 10)
    except ValueError:
        raise ValueError(f"WATCHDOG_USEC={usec!r} is no count of microseconds: whatever started peerd set it "
                         "wrongly (systemd sets it from WatchdogSec=)") from None
