"""What each op's successful reply body holds: both sides check it, so neither trusts an ad hoc dict.

Fields beyond these may appear (status carries the daemon's whole picture); the ones named here
are what callers read, each with its type.
"""

from __future__ import annotations

from typing import Any

from .protocol import ErrorCode, Field, ProtocolError

_NUMBER = (int, float)


def _each(kind: type | tuple[type, ...]):
    return lambda values: None if all(isinstance(v, kind) for v in values) else f"must hold only {kind}"


_VERDICT = {"ok": Field(bool), "reason": Field(str)}
_HELLO = {
    "version": Field(str), "protocol": Field(int), "pid": Field(int), "backend": Field(str),
    "rendezvous_timeout": Field(_NUMBER), "agreement_timeout": Field(_NUMBER),
}

REPLIES: dict[str, dict[str, Field]] = {
    "join": {"backend": Field(str), "handles": Field(list, _each(bytes)), "sizes": Field(list, _each(int)),
             "offsets": Field(list, _each(int)), "chunk_sizes": Field(list, _each(int)),
             "devices": Field(list, _each(str))},
    "commit": _VERDICT,
    "agree": _VERDICT,
    "release": {"freed": Field(bool)},
    "withdraw": {},
    "evict": {"evicted": Field(list, _each(dict))},
    "hello": _HELLO,
    "status": {**_HELLO, "health": Field(str), "problems": Field(list), "draining": Field(bool)},
    "ls": {"groups": Field(list, _each(dict)), "more": Field(bool)},
}


def check_reply(op: str, body: Any) -> None:
    """ProtocolError (BAD_REQUEST) naming what is wrong with a reply body to ``op``."""
    if not isinstance(body, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"the {op} reply is {type(body).__name__}, not a map")
    for name, spec in REPLIES[op].items():
        if name not in body:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"the {op} reply lacks {name!r}")
        value = body[name]
        wrong_bool = isinstance(value, bool) and spec.kind is not bool and bool not in _tuple(spec.kind)
        problem = f"is {type(value).__name__}" if wrong_bool or not isinstance(value, spec.kind) else spec.check(value)
        if problem:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"the {op} reply's {name!r} {problem}")


def _tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)
