"""What the daemon keeps by key as things come and go, never growing after they went.

``Index``: things under a key (the sets, control page areas and agreements of each pid), so a
death looks at its own pid's entries alone. ``tally``: a count under a key (bytes, sets,
connections of each uid), so a limit check costs one lookup however much the daemon keeps.
"""

from __future__ import annotations

from typing import Any, Generic, Hashable, TypeVar

K = TypeVar("K", bound=Hashable)
I = TypeVar("I", bound=Hashable)
V = TypeVar("V")


class Index(dict, Generic[K, I, V]):
    """``key -> {id: thing}``; compares equal to the plain dict of dicts it holds."""

    def add(self, key: K, ident: I, thing: V) -> None:
        self.setdefault(key, {})[ident] = thing

    def discard(self, key: K, ident: I) -> None:
        """Forget ``ident`` under ``key``; the key goes with its last entry."""
        inner = self.get(key)
        if inner is not None:
            inner.pop(ident, None)
            if not inner:
                del self[key]


def tally(table: dict[Any, int], key: Hashable, delta: int) -> None:
    """Add to a tally; a key that reaches zero leaves the table, so nothing grows."""
    table[key] = table.get(key, 0) + delta
    if not table[key]:
        del table[key]
