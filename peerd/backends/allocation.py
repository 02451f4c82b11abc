"""What a backend hands the registry for one rank's buffer.

A plain record, apart from the rules that use it, so that a worker importing
``peerd.backends`` for its mappers loads nothing of the daemon's registry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Allocation:
    """One rank's buffer: its backend, exported handle, size and device; opaque ``token`` is the backend's own."""

    backend: str
    handle: bytes
    size: int
    device: str
    token: Any = None
