"""`ls` in pages: a listing at the limits (4096 sets of the longest keys) still fits a reply.

Entries sort by (group, name, owner uid); a client's cursor is the position
of the last entry it received, so pages never repeat or skip a set however
many users share a key.
"""

from __future__ import annotations

import bisect
from typing import Any

import msgpack


def position(entry: dict[str, Any]) -> tuple:
    """Where a listing entry sorts, and what a client's `ls` cursor names: group, name, owner uid."""
    return entry["group"], entry["name"], -1 if entry["uid"] is None else entry["uid"]


def page(entries: list[dict[str, Any]], after: list | None, limit: int, max_bytes: int) -> tuple[list[dict], bool]:
    """The entries after the cursor, at most ``limit`` of them and about ``max_bytes`` packed; whether more follow."""
    entries = sorted(entries, key=position)
    start = 0 if after is None else bisect.bisect_right(entries, tuple(after), key=position)
    shown: list[dict] = []
    size = 0
    for entry in entries[start:start + limit]:
        size += len(msgpack.packb(entry, use_bin_type=True))
        if shown and size > max_bytes:
            break
        shown.append(entry)
    return shown, start + len(shown) < len(entries)
