"""The wire: one msgpack map per ZeroMQ frame, the one module daemon and client share.

A request is ``{v, id, op, body}``; a reply is ``{v, id, ok: true, body}`` or
``{v, id, ok: false, error: {code, message}}``. The envelope never mixes with
the payload, so no op's field can overwrite ``ok`` (circus's mistake). Every
field of every op is declared once in ``OPS`` and checked on arrival: the
daemon trusts nothing it did not validate, and the client learns of a bad
call from a coded error, not from a crash on the other side.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable

import msgpack

VERSION = 1

#: seconds a join or an agreement waits for every rank unless the client or the operator sets
#: another; the daemon announces its current value in hello and clients send it back as the deadline
DEFAULT_DEADLINE_S = 60.0

#: Largest reply frame a client accepts.
MAX_FRAME_BYTES = 1 << 20

#: Largest request frame the daemon accepts (its ZMQ_MAXMSGSIZE): the largest
#: valid request, every string at its longest in 4-byte UTF-8, needs under 6 KiB,
#: so a bigger frame is dropped at its header, before libzmq buffers it.
MAX_REQUEST_BYTES = 8 << 10

#: Longest group key or buffer-set name (and device identity).
MAX_KEY_CHARS = 128

#: Longest reason a rank may give with a failed commit vote.
MAX_REASON_CHARS = 1024

#: Most buffer sets one `ls` reply carries; the daemon also stops a page at
#: LS_PAGE_BYTES, so every reply stays far below a client's MAX_FRAME_BYTES.
MAX_LS_PAGE = 1024
LS_PAGE_BYTES = 32 << 10

#: Most ranks one group may have.
MAX_RANKS = 1024

#: Largest size the wire carries (a signed 64-bit count): the daemon's own
#: limit (--max-buffer-bytes) is what refuses a size, in words a user can act on.
MAX_NBYTES = (1 << 63) - 1

#: Longest timeout a caller may ask for, in seconds.
MAX_TIMEOUT_S = 24 * 3600.0

#: ``flags`` bit: ask for fine-grained instead of uncached memory (hip only).
FLAG_FINE_GRAINED = 0x1
KNOWN_FLAGS = FLAG_FINE_GRAINED


class ErrorCode(str, enum.Enum):
    """Stable error names: clients branch on these, so never rename one."""

    BAD_REQUEST = "BAD_REQUEST"  # not msgpack, not a map, a field missing or mistyped
    UNSUPPORTED_VERSION = "UNSUPPORTED_VERSION"
    UNKNOWN_OP = "UNKNOWN_OP"
    MISMATCH = "MISMATCH"  # ranks of one buffer set disagree on npes, nbytes or flags
    RANK_INVALID = "RANK_INVALID"  # rank outside 0..npes-1
    RANK_TAKEN = "RANK_TAKEN"  # another live process holds that rank
    TIMEOUT = "TIMEOUT"  # a rendezvous or agreement ran out of time
    RANK_DIED = "RANK_DIED"  # a rank's process died while others waited on it
    GROUP_FAILED = "GROUP_FAILED"  # the buffer set failed earlier; the reason says why
    NOT_FOUND = "NOT_FOUND"  # no such buffer set or rank
    NOT_MEMBER = "NOT_MEMBER"  # the rank belongs to another process
    ALLOCATION_FAILED = "ALLOCATION_FAILED"
    DEVICE_UNKNOWN = "DEVICE_UNKNOWN"  # the daemon serves no device of that identity
    FORBIDDEN = "FORBIDDEN"  # the caller's uid or gid is not allowed, or the group is another user's
    LIMIT_EXCEEDED = "LIMIT_EXCEEDED"  # a configured limit would be passed; the message names it
    SHUTTING_DOWN = "SHUTTING_DOWN"
    INTERNAL = "INTERNAL"


class ProtocolError(Exception):
    """A coded error: raised where a request is refused, sent back as the reply."""

    def __init__(self, code: ErrorCode, message: str, request_id: int | None = None):
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id  # where known, so the refusal reaches its caller


# ---------------------------------------------------------------- field types


@dataclass(frozen=True)
class Field:
    """One body field: its Python type and the check its value must pass."""

    kind: type | tuple[type, ...]
    check: Callable[[Any], str | None] = lambda value: None
    default: Any = ...  # ... means required

    @property
    def required(self) -> bool:
        return self.default is ...


def _key(value: str) -> str | None:
    if not value or len(value) > MAX_KEY_CHARS:
        return f"must be 1 to {MAX_KEY_CHARS} characters"
    if not value.isprintable():
        bad = next(c for c in value if not c.isprintable())
        return f"must be printable: it holds the control character {bad!r} (use letters, digits and punctuation)"
    return None


def _cursor(value: list | None) -> str | None:
    if value is None:
        return None
    if (len(value) != 3 or not all(isinstance(v, str) and len(v) <= MAX_KEY_CHARS for v in value[:2])
            or isinstance(value[2], bool) or not isinstance(value[2], int)):
        return f"must be [group, name, uid]: two strings of at most {MAX_KEY_CHARS} characters and an integer"
    return None


def _between(low: float, high: float) -> Callable[[Any], str | None]:
    def check(value: float) -> str | None:
        if not low <= value <= high:
            return f"must be between {low} and {high}, got {value}"
        return None

    return check


def _timeout(value: float | None) -> str | None:
    if value is None:
        return None
    if not 0 < value <= MAX_TIMEOUT_S:
        return f"must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], got {value}"
    return None


def _flags(value: int) -> str | None:
    if value & ~KNOWN_FLAGS:
        return f"has unknown bits {value & ~KNOWN_FLAGS:#x} (known: {KNOWN_FLAGS:#x})"
    return None


_REASON = Field(str, lambda v: None if len(v) <= MAX_REASON_CHARS else f"longer than {MAX_REASON_CHARS}", "")
_TIMEOUT = Field((int, float, type(None)), _timeout, None)
_GROUP = Field(str, _key)
_RANK = Field(int, _between(0, MAX_RANKS - 1))
_NPES = Field(int, _between(1, MAX_RANKS))

#: Every op and its body schema. The daemon dispatches on these names and the
#: client builds its calls from them: one verb, one place.
OPS: dict[str, dict[str, Field]] = {
    # Join buffer set (group, name) as `rank`; the reply waits for every rank.
    "join": {
        "group": _GROUP,
        "name": Field(str, _key),
        "rank": _RANK,
        "npes": _NPES,
        "nbytes": Field(int, _between(1, MAX_NBYTES)),
        "device": Field(str, _key),
        "flags": Field(int, _flags, 0),
        "timeout": _TIMEOUT,
    },
    # Vote that this rank opened every peer's handle (or why it could not).
    "commit": {
        "group": _GROUP,
        "name": Field(str, _key),
        "rank": _RANK,
        "ok": Field(bool),
        "reason": _REASON,
        "timeout": _TIMEOUT,
    },
    # This rank cannot take part (its backend or device is unusable here): fail the
    # rendezvous for every rank at once, and keep the verdict for ranks still to come.
    "withdraw": {
        "group": _GROUP,
        "name": Field(str, _key),
        "rank": _RANK,
        "npes": _NPES,
        "reason": Field(str, _REASON.check),
    },
    # Drop this rank's hold on the buffer set.
    "release": {
        "group": _GROUP,
        "name": Field(str, _key),
        "rank": _RANK,
    },
    # One round of tp_agree: the k-th call of each rank forms round k.
    "agree": {
        "group": _GROUP,
        "rank": _RANK,
        "npes": _NPES,
        "ok": Field(bool),
        "timeout": _TIMEOUT,
    },
    # Free a stuck group by force (root or the daemon's uid); name None: every set of it;
    # uid None: that group in every uid's namespace.
    "evict": {
        "group": _GROUP,
        "name": Field((str, type(None)), lambda v: None if v is None else _key(v), None),
        "uid": Field((int, type(None)), lambda v: None if v is None or v >= 0 else "must be a uid (>= 0)", None),
    },
    # First call of every connection: proves the daemon answers, gives its defaults.
    "hello": {},
    "status": {},
    # One page of the buffer sets, in (group, name, uid) order, after the cursor
    # [group, name, uid] (the last entry of the previous page; None: from the start).
    "ls": {
        "after": Field((list, type(None)), _cursor, None),
        "limit": Field(int, _between(1, MAX_LS_PAGE), MAX_LS_PAGE),
    },
}


def _type_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join("null" if k is type(None) else k.__name__ for k in kinds)


def validate_body(op: str, body: Any) -> dict[str, Any]:
    """The body with defaults filled in, or ProtocolError naming the bad field."""
    schema = OPS[op]
    if not isinstance(body, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{op}: body must be a map")
    unknown = set(body) - set(schema)
    if unknown:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"{op}: unknown field(s) {sorted(map(str, unknown))}"
        )
    clean = {}
    for name, field in schema.items():
        if name not in body:
            if field.required:
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"{op}: missing field {name!r}")
            clean[name] = field.default
            continue
        value = body[name]
        # bool is an int in Python; a vote of 1 or a rank of True is a mistake.
        wrong_bool = isinstance(value, bool) != (field.kind is bool)
        if not isinstance(value, field.kind) or (wrong_bool and value is not None):
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"{op}: field {name!r} must be {_type_name(field.kind)}, "
                f"got {type(value).__name__}",
            )
        problem = field.check(value)
        if problem:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{op}: field {name!r} {problem}")
        clean[name] = value
    return clean


# ---------------------------------------------------------------- envelopes


@dataclass(frozen=True)
class Request:
    id: int
    op: str
    body: dict[str, Any]


def _pack(message: dict[str, Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def _unpack(frame: bytes, max_bytes: int = MAX_FRAME_BYTES) -> Any:
    if len(frame) > max_bytes:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"frame of {len(frame)} bytes exceeds the limit of {max_bytes}")
    try:
        return msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.exceptions.UnpackException) as err:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"not a msgpack message ({type(err).__name__}: {err})") from None


def encode_request(request_id: int, op: str, body: dict[str, Any]) -> bytes:
    return _pack({"v": VERSION, "id": request_id, "op": op, "body": body})


def request_id_of(message: Any) -> int | None:
    """The id to answer under, when the message carries a usable one."""
    if isinstance(message, dict):
        rid = message.get("id")
        if isinstance(rid, int) and not isinstance(rid, bool) and 0 <= rid < 1 << 63:
            return rid
    return None


def decode_request(frame: bytes, max_bytes: int = MAX_REQUEST_BYTES) -> Request:
    """A validated request, or ProtocolError saying what is wrong with the frame."""
    message = _unpack(frame, max_bytes)
    if not isinstance(message, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "message must be a map")
    rid = request_id_of(message)
    try:
        if message.get("v") != VERSION:
            raise ProtocolError(
                ErrorCode.UNSUPPORTED_VERSION,
                f"protocol version {message.get('v')!r} is not {VERSION}; "
                "upgrade the client and the daemon together",
            )
        if rid is None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "field 'id' must be a non-negative integer")
        op = message.get("op")
        if not isinstance(op, str):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "field 'op' must be a string")
        if op not in OPS:
            raise ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown op {op!r}; known: {sorted(OPS)}")
        extra = set(message) - {"v", "id", "op", "body"}
        if extra:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"unknown envelope field(s) {sorted(map(str, extra))}")
        return Request(rid, op, validate_body(op, message.get("body", {})))
    except ProtocolError as err:
        err.request_id = rid
        raise


def encode_reply(request_id: int, body: dict[str, Any]) -> bytes:
    return _pack({"v": VERSION, "id": request_id, "ok": True, "body": body})


def encode_error(request_id: int | None, code: ErrorCode, message: str) -> bytes:
    return _pack(
        {"v": VERSION, "id": request_id, "ok": False, "error": {"code": code.value, "message": message}}
    )


@dataclass(frozen=True)
class Reply:
    id: int | None
    ok: bool
    body: dict[str, Any]
    error: ProtocolError | None


def decode_reply(frame: bytes) -> Reply:
    """A reply from the daemon; an ill-formed one raises ProtocolError."""
    message = _unpack(frame)
    if not isinstance(message, dict) or not isinstance(message.get("ok"), bool):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "reply must be a map with a boolean 'ok'")
    if message.get("v") != VERSION:
        raise ProtocolError(
            ErrorCode.UNSUPPORTED_VERSION,
            f"daemon speaks protocol version {message.get('v')!r}, this client {VERSION}",
        )
    rid = request_id_of(message)
    if message["ok"]:
        body = message.get("body")
        if not isinstance(body, dict):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "reply body must be a map")
        return Reply(rid, True, body, None)
    error = message.get("error")
    if not isinstance(error, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "error reply without an 'error' map")
    try:
        code = ErrorCode(error.get("code"))
    except ValueError:
        code = ErrorCode.INTERNAL
    return Reply(rid, False, {}, ProtocolError(code, str(error.get("message", ""))))
