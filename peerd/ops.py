"""Every op the daemon serves, each declared once: its request, its reply, its errors, who may call it.

One record per op (circus keeps one command per module; jupyter_client one written spec).
The daemon decodes requests, admits callers and resolves handlers from these records; the
client validates its requests before they leave and every reply when it comes back; the
daemon checks each error it sends against the op's list; ``docs/protocol.md`` is written
from them (``python -m peerd.protodoc``). Standard library and msgpack only: workers load it.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat
from typing import Any

from .protocol import (
    KNOWN_FLAGS,
    MAX_KEY_CHARS,
    MAX_LS_PAGE,
    MAX_NBYTES,
    MAX_RANKS,
    MAX_REASON_CHARS,
    MAX_REQUEST_BYTES,
    MAX_TIMEOUT_S,
    ErrorCode,
    Field,
    ProtocolError,
    Request,
    Schema,
    between,
    check_fields,
    decode_envelope,
    is_wait,
    key,
)

E = ErrorCode

#: What any op may answer: a malformed or refused request, or a bug on the daemon's side.
COMMON_ERRORS = (E.BAD_REQUEST, E.UNSUPPORTED_VERSION, E.UNKNOWN_OP, E.FORBIDDEN, E.INTERNAL)

#: What a rendezvous or commit answers once its set failed: the failure's own code (Note [Failure verdicts are kept]).
SET_FAILURES = (E.MISMATCH, E.TIMEOUT, E.RANK_DIED, E.GROUP_FAILED, E.ALLOCATION_FAILED, E.DEVICE_UNKNOWN,
                E.LIMIT_EXCEEDED, E.SHUTTING_DOWN)


@dataclass(frozen=True)
class Op:
    """One op: what it means, the fields both ways, the errors it answers, who may call it, who serves it."""

    name: str
    means: str
    request: dict[str, Field]
    reply: dict[str, Field]
    errors: tuple[ErrorCode, ...] = ()  # beyond COMMON_ERRORS
    admin_only: bool = False  # root and the daemon's uid only: it reaches every uid's groups
    while_draining: bool = True  # served after SIGTERM, while held buffers are given back
    registry: bool = False  # served by Registry.<name>, else by the daemon
    #: the caller may be left holding or waiting on something, whose death the daemon must see: it watches the
    #: caller's pid first (a pidfd, at most --max-processes-per-uid live ones per uid: LIMIT_EXCEEDED past that)
    watches: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "request", Schema(self.request))  # checked on every call: steps read once
        object.__setattr__(self, "reply", Schema(self.reply))

    def answers(self, code: ErrorCode) -> bool:
        return code in COMMON_ERRORS or code in self.errors


def _cursor(value: list | None) -> str | None:
    if value is None:
        return None
    if (len(value) not in (3, 4) or not all(isinstance(v, str) and len(v) <= MAX_KEY_CHARS for v in value[:2])
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in value[2:])):
        return (f"must be [group, name, uid, set] (or [group, name, uid]: after every set of that key): two "
                f"strings of at most {MAX_KEY_CHARS} characters and integers")
    return None


def _timeout(value: float | None) -> str | None:
    if value is not None and not is_wait(value):
        return f"must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], got {value}"
    return None


def _flags(value: int) -> str | None:
    return f"has unknown bits {value & ~KNOWN_FLAGS:#x} (known: {KNOWN_FLAGS:#x})" if value & ~KNOWN_FLAGS else None


def _reason(value: str) -> str | None:
    return None if len(value) <= MAX_REASON_CHARS else f"longer than {MAX_REASON_CHARS}"


def _page(value: list) -> str | None:
    """A join reply's control page: [area id, offset in the area, generation (the set's id)]; absent: none."""
    if len(value) != 3 or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        return "must be [area id, offset, generation]: three integers >= 0"
    return None


#: the most a pid can be on Linux (PID_MAX_LIMIT on 64-bit)
MAX_PID = 1 << 22


def _own_pid(value: list) -> str | None:
    """A rank's own pid as it claims it: [its pid namespace, as /proc/self/ns/pid names it, its pid there]."""
    if (len(value) != 2 or not isinstance(value[0], str) or key(value[0]) is not None
            or isinstance(value[1], bool) or not isinstance(value[1], int) or not 1 <= value[1] <= MAX_PID):
        return (f"must be [pid namespace, pid]: a string of 1 to {MAX_KEY_CHARS} printable characters and an "
                f"integer in [1, {MAX_PID}]")
    return None


def _own_pid_or_none(value: list | None) -> str | None:
    return None if value is None else _own_pid(value)


def _own_pids(values: list) -> str | None:
    """Each rank's claimed own pid (as above), or null where it sent none."""
    for value in values:
        problem = _own_pid_or_none(value) if isinstance(value, (list, type(None))) else "must be a list"
        if problem:
            return f"holds {value!r}, which {problem}"
    return None


def _each(kind: type | tuple[type, ...]):
    """Every element a ``kind`` (looped in C: a join reply holds several lists of one entry per rank)."""
    return lambda values: None if all(map(isinstance, values, repeat(kind))) else f"must hold only {kind}"


_GROUP = Field(str, key)
_NAME = Field(str, key)
_RANK = Field(int, between(0, MAX_RANKS - 1))
_NPES = Field(int, between(1, MAX_RANKS))
_TIMEOUT = Field((int, float, type(None)), _timeout, None)
_SLOT = {"group": _GROUP, "name": _NAME, "rank": _RANK}
#: the set the rank joined (the join reply's ``set``): the daemon answers for that set alone
_SET = Field((int, type(None)), lambda v: None if v is None or v >= 0 else "must be >= 0", None)
_VERDICT = {"ok": Field(bool), "reason": Field(str)}
_NUMBER = (int, float)
_HELLO = {
    "instance": Field(int), "version": Field(str), "protocol": Field(int), "pid": Field(int), "backend": Field(str),
    "rendezvous_timeout": Field(_NUMBER), "agreement_timeout": Field(_NUMBER),
}

OPS: dict[str, Op] = {op.name: op for op in (
    Op("join", "Join buffer set (group, name) as `rank`; the reply waits for every rank and carries every "
       "rank's handle.",
       {**_SLOT, "npes": _NPES, "nbytes": Field(int, between(1, MAX_NBYTES)), "device": Field(str, key),
        "flags": Field(int, _flags, 0), "timeout": _TIMEOUT,
        "own_pid": Field((list, type(None)), _own_pid_or_none, None)},
       {"backend": Field(str), "handles": Field(list, _each(bytes)), "sizes": Field(list, _each(int)),
        "offsets": Field(list, _each(int)), "chunk_sizes": Field(list, _each(int)), "devices": Field(list, _each(str)),
        "pids": Field(list, _each(int), None), "own_pids": Field(list, _own_pids, None),
        "page": Field(list, _page, None), "set": Field(int),
        "supersedes": Field(list, _each(int), None)},
       errors=(E.RANK_INVALID, E.RANK_TAKEN, *SET_FAILURES),
       while_draining=False,  # a new set would outlive the drain
       registry=True, watches=True),
    Op("commit", "Vote that this rank opened every peer's handle (or why it could not); the reply is the "
       "set's verdict. With `page` true the rank voted on the set's control page and had the verdict there: "
       "nothing answers it but a refusal, and a yes counts once the page shows the round agreed (peerd_client "
       "posts only a no: the daemon reads a yes off the page).",
       {**_SLOT, "ok": Field(bool), "reason": Field(str, _reason, ""), "timeout": _TIMEOUT,
        "page": Field(bool, None, False), "set": _SET},
       _VERDICT,
       errors=(E.NOT_FOUND, E.NOT_MEMBER, *SET_FAILURES),
       registry=True),
    Op("withdraw", "This rank cannot take part (its backend or device is unusable here): fail the rendezvous "
       "for every rank at once, and keep the verdict for ranks still to come.",
       {**_SLOT, "npes": _NPES, "reason": Field(str, _reason)},
       {},
       errors=(E.RANK_INVALID, E.RANK_TAKEN),
       registry=True),
    Op("release", "Drop this rank's hold on the buffer set; the memory is freed once no rank holds it. "
       "`set` (the join reply's) names the set the hold was taken in: a release sent again after its "
       "first delivery (a retry, a restarted daemon) never ends a later set's hold of the same rank.",
       {**_SLOT, "set": _SET},
       {"freed": Field(bool)},
       errors=(E.NOT_FOUND, E.NOT_MEMBER, *SET_FAILURES),
       registry=True),
    Op("agree", "One round of tp_agree: the k-th call of each rank forms round k; the reply is the AND of "
       "the votes, or False with the reason.",
       {"group": _GROUP, "rank": _RANK, "npes": _NPES, "ok": Field(bool), "timeout": _TIMEOUT},
       _VERDICT,
       errors=(E.RANK_INVALID, E.NOT_MEMBER, E.MISMATCH, E.LIMIT_EXCEEDED, E.SHUTTING_DOWN),
       registry=True, watches=True),
    Op("evict", "Free a stuck group by force, whoever holds it; name null: every set of it; uid null: that "
       "group in every uid's namespace.",
       {"group": _GROUP, "name": Field((str, type(None)), lambda v: None if v is None else key(v), None),
        "uid": Field((int, type(None)), lambda v: None if v is None or v >= 0 else "must be a uid (>= 0)", None)},
       {"evicted": Field(list, _each(dict))},
       admin_only=True),
    Op("hello", "First call of every connection: proves the daemon answers, gives its pid, backend and "
       "default deadlines.", {}, _HELLO),
    Op("status", "The daemon's health and picture, for `peerd status` (other users' groups only to "
       "administrators).",
       {}, {**_HELLO, "health": Field(str), "problems": Field(list), "draining": Field(bool)}),
    Op("ls", "One page of the caller's buffer sets in (group, name, uid, set) order, after the cursor (the "
       "position of the last entry of the previous page; null: from the start).",
       {"after": Field((list, type(None)), _cursor, None), "limit": Field(int, between(1, MAX_LS_PAGE), MAX_LS_PAGE)},
       {"groups": Field(list, _each(dict)), "more": Field(bool)}),
)}


def validate_request(op: str, body: Any) -> dict[str, Any]:
    """The body with defaults filled in, or ProtocolError naming the bad field (both sides call it)."""
    return check_fields(op, OPS[op].request, body, closed=True)


def check_reply(op: str, body: Any) -> None:
    """ProtocolError (BAD_REQUEST) naming what is wrong with a reply body to ``op``.

    Replies are open: fields beyond the declared ones may appear (status carries the daemon's
    whole picture); the declared ones are what callers read.
    """
    check_fields(f"the {op} reply", OPS[op].reply, body, closed=False)


def decode_request(frame: bytes, max_bytes: int = MAX_REQUEST_BYTES) -> Request:
    """A validated request, or ProtocolError saying what is wrong with the frame."""
    request_id, op, body = decode_envelope(frame, max_bytes)
    try:
        if op not in OPS:
            raise ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown op {op!r}; known: {sorted(OPS)}")
        return Request(request_id, op, validate_request(op, body))
    except ProtocolError as err:
        err.request_id = request_id
        raise
