"""The exceptions a worker sees."""

from __future__ import annotations


class MonoUnsupported(Exception):
    """The loaded model or runtime configuration is outside what mono serves.

    Raised on every rank when any rank fails to set up peer memory; the
    message says which rank failed and why. ``code`` is the daemon's stable
    error name (peerd.protocol.ErrorCode) where the daemon refused the call.
    """

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code


#: ``.code`` of a rank whose backend or device cannot be used on this machine
BACKEND_UNAVAILABLE = "BACKEND_UNAVAILABLE"


class DaemonUnavailable(MonoUnsupported):
    """No peerd daemon answered: none is running, it died, or it was restarted."""

    def __init__(self, message: str, code: str | None = "DAEMON_UNAVAILABLE"):
        super().__init__(message, code)


class ForkedProcessError(RuntimeError):
    """A forked child touched its parent's peerd connection or mappings."""
