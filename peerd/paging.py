"""`ls` in pages: a listing at the limits (4096 sets of the longest keys) still fits a reply.

Entries sort by (group, name, owner uid, set id); a client's cursor is the
position of the last entry it received, so pages never repeat or skip a set
however many users share a key, nor however many sets one key has (a
retired set still held beside the one joining: a cursor without the set id
skipped the rest of them). Only the page's entries are rendered: a user asking
for `ls` in a loop costs the daemon a sort of its own sets' keys per page,
not a description of every one of them.
"""

from __future__ import annotations

import bisect
from typing import Any, Callable, TypeVar

import msgpack

T = TypeVar("T")


def page(things: list[T], position: Callable[[T], tuple], render: Callable[[T], dict[str, Any]],
         after: list | None, limit: int, max_bytes: int) -> tuple[list[dict], bool]:
    """The rendered entries after the cursor, at most ``limit`` of them and about ``max_bytes`` packed; whether
    more follow. ``position`` is where a thing sorts (and what a cursor names); ties keep their order. A
    cursor shorter than a position is a prefix: after every thing that shares it."""
    things = sorted(things, key=position)
    start = 0 if after is None else bisect.bisect_right(things, tuple(after), key=lambda t: position(t)[:len(after)])
    shown: list[dict] = []
    size = 0
    for thing in things[start:start + limit]:
        entry = render(thing)
        size += len(msgpack.packb(entry, use_bin_type=True))
        if shown and size > max_bytes:
            break
        shown.append(entry)
    return shown, start + len(shown) < len(things)
