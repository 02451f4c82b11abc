"""Reply schemas: a well-formed reply passes, a wrong or missing field is named."""

import pytest

from peerd.protocol import OPS, ErrorCode, ProtocolError
from peerd.replies import REPLIES, check_reply

HELLO = {"version": "1.0", "protocol": 1, "pid": 7, "backend": "host",
         "rendezvous_timeout": 60.0, "agreement_timeout": 60}
GOOD = {
    "join": {"backend": "host", "handles": [b"a", b"b"], "sizes": [4096, 4096], "devices": ["host", "host"]},
    "commit": {"ok": True, "reason": ""},
    "agree": {"ok": False, "reason": "rank 1 voted no"},
    "release": {"freed": True},
    "withdraw": {},
    "evict": {"evicted": [{"group": "g", "name": "default", "uid": 0}]},
    "hello": HELLO,
    "status": {**HELLO, "health": "healthy", "problems": [], "draining": False, "devices": []},
    "ls": {"groups": [], "more": False},
}


def test_every_op_has_a_reply_schema():
    assert set(REPLIES) == set(OPS) == set(GOOD)


@pytest.mark.parametrize("op", sorted(GOOD))
def test_a_well_formed_reply_passes(op):
    check_reply(op, GOOD[op])


@pytest.mark.parametrize("op, body, named", [
    ("join", {**GOOD["join"], "sizes": [4096, "4096"]}, "'sizes'"),
    ("join", {k: v for k, v in GOOD["join"].items() if k != "handles"}, "'handles'"),
    ("commit", {"ok": 1, "reason": ""}, "'ok'"),
    ("release", {"freed": None}, "'freed'"),
    ("hello", {**HELLO, "pid": True}, "'pid'"),
    ("ls", [], "not a map"),
])
def test_a_bad_reply_names_what_is_wrong(op, body, named):
    with pytest.raises(ProtocolError) as caught:
        check_reply(op, body)
    assert caught.value.code is ErrorCode.BAD_REQUEST and named in caught.value.message
