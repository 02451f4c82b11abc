"""The wire: one msgpack map per ZeroMQ frame, the one module daemon and client share.

A request is ``{v, id, op, body}``; a reply is ``{v, id, ok: true, body}`` or
``{v, id, ok: false, error: {code, message}}``. The envelope never mixes with
the payload, so no op's field can overwrite ``ok`` (circus's mistake). Every
field of every op is declared once in ``peerd.ops`` and checked on arrival:
the daemon trusts nothing it did not validate, and the client learns of a
bad call from a coded error, not from a crash on the other side. This module
holds what every op shares: the envelope, the limits, the error codes and
the field checks.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import Any, Callable

import msgpack

VERSION = 4  # 2: commit takes `page`; 3: join answers `set`, release names it, the fd channel sends an fd once;
# 4: a connection names itself with an unguessable routing id (peerd.routingids)

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


def is_wait(seconds: float, zero: bool = False) -> bool:
    """Whether ``seconds`` is a wait the protocol carries: in (0, MAX_TIMEOUT_S], or from 0 where ``zero``
    (at once). nan and inf fail both comparisons, so neither is one."""
    return (0 <= seconds if zero else 0 < seconds) and seconds <= MAX_TIMEOUT_S

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
    RANK_TAKEN = "RANK_TAKEN"  # another live process holds that rank (only the second claim is refused)
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
    check: Callable[[Any], str | None] | None = None
    default: Any = ...  # ... means required

    def __post_init__(self) -> None:
        # bool is an int in Python; a vote of 1 or a rank of True is a mistake: decided once, here
        kinds = self.kind if isinstance(self.kind, tuple) else (self.kind,)
        object.__setattr__(self, "refuses_bool", bool not in kinds)

    @property
    def required(self) -> bool:
        return self.default is ...


def key(value: str) -> str | None:
    """A group key, set name or device identity: short and printable, so logs and tables stay honest."""
    if not value or len(value) > MAX_KEY_CHARS:
        return f"must be 1 to {MAX_KEY_CHARS} characters"
    if not value.isprintable():
        bad = next(c for c in value if not c.isprintable())
        return f"must be printable: it holds the control character {bad!r} (use letters, digits and punctuation)"
    return None


def between(low: float, high: float) -> Callable[[Any], str | None]:
    def check(value: float) -> str | None:
        if not low <= value <= high:
            return f"must be between {low} and {high}, got {value}"
        return None

    return check


def type_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join("null" if k is type(None) else k.__name__ for k in kinds)


def check_fields(where: str, schema: dict[str, Field], body: Any, closed: bool) -> dict[str, Any]:
    """``body`` checked against ``schema``, defaults filled in; ProtocolError (BAD_REQUEST) naming the bad field.

    ``closed``: fields the schema does not name are refused (requests), else passed through (replies).
    """
    if not isinstance(body, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{where}: body must be a map, not {type(body).__name__}")
    if closed and not body.keys() <= schema.keys():
        unknown = body.keys() - schema.keys()
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{where}: unknown field(s) {sorted(map(str, unknown))}")
    clean = dict(body)
    for name, field, kind, refuses_bool, check in _steps(schema):
        value = body.get(name, field)
        if value is field:
            if field.required:
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"{where}: missing field {name!r}")
            clean[name] = field.default
            continue
        if not isinstance(value, kind) or (refuses_bool and isinstance(value, bool)):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{where}: field {name!r} must be "
                                f"{type_name(kind)}, got {type(value).__name__}")
        problem = check and check(value)
        if problem:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{where}: field {name!r} {problem}")
    return clean


class Schema(dict):
    """A body's Fields by name, whose checking steps are read off the Fields once: every request and
    reply of the hot path is checked, and attribute lookups were most of a check's time."""

    @functools.cached_property
    def steps(self) -> list[tuple]:
        """(name, field, kind, refuses_bool, check) per field."""
        return [(name, f, f.kind, f.refuses_bool, f.check) for name, f in self.items()]


def _steps(schema: dict[str, Field]) -> list[tuple]:
    return (schema if isinstance(schema, Schema) else Schema(schema)).steps


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


def decode_envelope(frame: bytes, max_bytes: int = MAX_REQUEST_BYTES) -> tuple[int, str, Any]:
    """A request's id, op name and raw body (peerd.ops checks the op and its body), or ProtocolError."""
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
        extra = set(message) - {"v", "id", "op", "body"}
        if extra:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"unknown envelope field(s) {sorted(map(str, extra))}")
        return rid, op, message.get("body", {})
    except ProtocolError as err:
        err.request_id = rid
        raise


def pack_body(body: dict[str, Any]) -> bytes:
    """A reply body packed once, for every caller it answers (a join's reply goes to every rank)."""
    return _pack(body)


#: what precedes and follows the id in every reply: the same bytes _pack makes of the whole map
_REPLY_HEAD = b"\x84" + _pack("v") + _pack(VERSION) + _pack("id")
_REPLY_OK = _pack("ok") + _pack(True) + _pack("body")


def encode_packed_reply(request_id: int, packed_body: bytes) -> bytes:
    return _REPLY_HEAD + _pack(request_id) + _REPLY_OK + packed_body


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
