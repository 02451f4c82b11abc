"""An index of things under a key (the sets, control page areas and agreements of each pid):
a dict of dicts whose inner dict leaves once its last entry does, so a death looks at its own
pid's entries alone and nothing grows after the entries go."""

from __future__ import annotations

from typing import Generic, Hashable, TypeVar

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
