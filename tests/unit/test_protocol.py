"""The wire schema: round trips, and a coded refusal for every malformed field."""

from __future__ import annotations

import msgpack
import pytest

from peerd import ops, protocol
from peerd.protocol import VERSION, ErrorCode, ProtocolError

JOIN = {"group": "g", "name": "n", "rank": 0, "npes": 2, "nbytes": 4096, "device": "host"}


def raw(message) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def refused(frame: bytes) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        ops.decode_request(frame)
    return info.value


def test_request_round_trip_fills_defaults():
    request = ops.decode_request(protocol.encode_request(7, "join", JOIN))
    assert request.id == 7 and request.op == "join"
    assert request.body == {**JOIN, "flags": 0, "timeout": None, "own_pid": None}


def reply_frame(request_id: int, body: dict) -> bytes:
    return protocol.encode_packed_reply(request_id, protocol.pack_body(body))


@pytest.mark.parametrize("request_id", [0, 127, 128, 65535, 65536, 1 << 40])
def test_a_reply_spliced_from_a_body_packed_once_is_the_map_packed_whole(request_id):
    """The daemon packs a join's body once for all ranks and splices each rank's id in: the bytes must be
    what msgpack makes of the whole reply, or a client would read another id or body."""
    body = {"handles": [b"h" * 64] * 8, "set": 5, "page": [1, 2, 3], "devices": ["GPU-x"] * 8}
    whole = msgpack.packb({"v": protocol.VERSION, "id": request_id, "ok": True, "body": body}, use_bin_type=True)
    assert reply_frame(request_id, body) == whole


def test_reply_and_error_round_trip():
    reply = protocol.decode_reply(reply_frame(3, {"handles": [b"\x00\x01"]}))
    assert reply.ok and reply.id == 3 and reply.body == {"handles": [b"\x00\x01"]}
    error = protocol.decode_reply(protocol.encode_error(4, ErrorCode.TIMEOUT, "rank 1 never came"))
    assert not error.ok and error.id == 4
    assert error.error.code is ErrorCode.TIMEOUT and error.error.message == "rank 1 never came"


def test_envelope_and_payload_stay_apart():
    """A body field named like an envelope field cannot overwrite it (circus's bug)."""
    reply = protocol.decode_reply(reply_frame(1, {"ok": False, "id": 99}))
    assert reply.ok is True and reply.id == 1 and reply.body == {"ok": False, "id": 99}


def test_error_codes_have_stable_names():
    assert all(code.value == code.name for code in ErrorCode)


@pytest.mark.parametrize(
    "frame, code, words",
    [
        (b"\xc1garbage", ErrorCode.BAD_REQUEST, "not a msgpack message"),
        (raw([1, 2, 3]), ErrorCode.BAD_REQUEST, "must be a map"),
        (raw({"v": 99, "id": 1, "op": "ls", "body": {}}), ErrorCode.UNSUPPORTED_VERSION, "version 99"),
        (raw({"v": VERSION, "id": -1, "op": "ls", "body": {}}), ErrorCode.BAD_REQUEST, "'id'"),
        (raw({"v": VERSION, "id": 1, "op": "fly", "body": {}}), ErrorCode.UNKNOWN_OP, "unknown op 'fly'"),
        (raw({"v": VERSION, "id": 1, "op": "ls", "body": {}, "x": 1}), ErrorCode.BAD_REQUEST, "envelope"),
        (raw({"v": VERSION, "id": 1, "op": "ls", "body": []}), ErrorCode.BAD_REQUEST, "body must be a map"),
        (b"\x00" * (protocol.MAX_FRAME_BYTES + 1), ErrorCode.BAD_REQUEST, "exceeds"),
    ],
)
def test_malformed_envelopes_are_refused_with_a_code(frame, code, words):
    err = refused(frame)
    assert err.code is code and words in err.message


@pytest.mark.parametrize(
    "change, words",
    [
        ({"rank": "0"}, "'rank' must be int"),
        ({"rank": True}, "'rank' must be int, got bool"),
        ({"nbytes": -1}, "'nbytes' must be between"),
        ({"nbytes": 0}, "'nbytes' must be between"),
        ({"nbytes": 1 << 63}, "'nbytes' must be between"),
        ({"npes": 0}, "'npes' must be between"),
        ({"group": ""}, "'group' must be 1 to"),
        ({"group": "g" * 300}, "'group' must be 1 to"),
        ({"flags": 0x80}, "unknown bits 0x80"),
        ({"timeout": -2}, "'timeout' must be a number of seconds"),
        ({"timeout": "soon"}, "'timeout' must be int or float or null"),
        ({"color": "red"}, "unknown field(s) ['color']"),
        ({"own_pid": ["pid:[4026531836]"]}, "'own_pid' must be [pid namespace, pid]"),
        ({"own_pid": ["pid:[4026531836]", 0]}, "'own_pid' must be [pid namespace, pid]"),
        ({"own_pid": ["pid:[4026531836]", True]}, "'own_pid' must be [pid namespace, pid]"),
        ({"own_pid": ["pid\n[1]", 5]}, "'own_pid' must be [pid namespace, pid]"),
        ({"own_pid": "pid:[1] 5"}, "'own_pid' must be list or null"),
    ],
)
def test_every_join_field_is_validated(change, words):
    err = refused(protocol.encode_request(5, "join", {**JOIN, **change}))
    assert err.code is ErrorCode.BAD_REQUEST and words in err.message
    assert err.request_id == 5, "a refusal must carry the request id so it reaches its caller"


@pytest.mark.parametrize("field", sorted(JOIN))
def test_missing_fields_are_named(field):
    body = {k: v for k, v in JOIN.items() if k != field}
    err = refused(protocol.encode_request(1, "join", body))
    assert f"missing field {field!r}" in err.message


def test_votes_must_be_booleans_not_ints():
    body = {"group": "g", "rank": 0, "npes": 2, "ok": 1}
    assert "'ok' must be bool" in refused(protocol.encode_request(1, "agree", body)).message


def test_a_reply_with_an_unknown_code_still_decodes():
    frame = raw({"v": VERSION, "id": 1, "ok": False, "error": {"code": "FROM_THE_FUTURE", "message": "m"}})
    assert protocol.decode_reply(frame).error.code is ErrorCode.INTERNAL


@pytest.mark.parametrize("field", ["group", "name"])
@pytest.mark.parametrize("bad", ["a\nb", "\x1b[2Jclear", "tab\there", "bell\x07", "del\x7f", "nel\x85", "line\u2028sep"])
def test_keys_and_names_with_control_characters_are_refused(field, bad):
    error = refused(protocol.encode_request(1, "join", {**JOIN, field: bad}))
    assert error.code is ErrorCode.BAD_REQUEST and "control character" in error.message
    assert error.request_id == 1


def test_printable_keys_pass_even_beyond_ascii():
    request = ops.decode_request(protocol.encode_request(1, "join", {**JOIN, "group": "tp-0 über/ζ"}))
    assert request.body["group"] == "tp-0 über/ζ"


def test_escape_makes_one_printable_line_of_any_text():
    import logging

    from peerd.escape import EscapingFormatter, escape

    assert escape("plain text, ü") == "plain text, ü"
    assert escape("a\nb\x1b[2J\u2028") == "a\\nb\\x1b[2J\\u2028"
    record = logging.LogRecord("peerd", logging.INFO, __file__, 1, "reason: %s", ("x\n2026 INFO forged",), None)
    assert EscapingFormatter("%(levelname)s %(message)s").format(record) == "INFO reason: x\\n2026 INFO forged"


def test_the_largest_valid_request_of_every_op_fits_the_daemons_frame_cap():
    """Every string at its longest in 4-byte UTF-8: the daemon's ZMQ_MAXMSGSIZE never cuts a valid request."""
    key = "\U0001F600" * protocol.MAX_KEY_CHARS
    longest = {
        "group": key, "name": key, "device": key, "reason": "\U0001F600" * protocol.MAX_REASON_CHARS,
        "rank": protocol.MAX_RANKS - 1, "npes": protocol.MAX_RANKS, "nbytes": protocol.MAX_NBYTES,
        "flags": protocol.KNOWN_FLAGS, "ok": False, "timeout": protocol.MAX_TIMEOUT_S,
        "after": [key, key, (1 << 32) - 1, (1 << 64) - 1], "uid": (1 << 32) - 1,
        "limit": protocol.MAX_LS_PAGE, "page": True, "set": (1 << 63) - 1, "own_pid": [key, ops.MAX_PID],
    }
    for op, schema in ((name, op.request) for name, op in ops.OPS.items()):
        body = {name: longest[name] for name in schema}
        frame = protocol.encode_request((1 << 63) - 1, op, body)
        assert len(frame) <= protocol.MAX_REQUEST_BYTES, (op, len(frame))
        assert ops.decode_request(frame).body == body


def test_the_flooders_speak_the_daemons_protocol_version():
    """tests/flooders.py runs as other users without peerd importable, so it keeps its own copy."""
    from tests import flooders

    assert flooders.VERSION == protocol.VERSION
