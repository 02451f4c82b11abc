"""Reply schemas: a well-formed reply passes, a wrong or missing field is named."""

import pytest

from peerd.ops import OPS, check_reply
from peerd.protocol import ErrorCode, ProtocolError

HELLO = {"instance": 3, "version": "1.0", "protocol": 1, "pid": 7, "backend": "host",
         "rendezvous_timeout": 60.0, "agreement_timeout": 60}
GOOD = {
    "join": {"backend": "host", "handles": [b"a", b"a"], "sizes": [4096, 4096], "offsets": [0, 4096],
             "chunk_sizes": [1 << 26, 1 << 26], "devices": ["host", "host"], "set": 1 << 40},
    "commit": {"ok": True, "reason": ""},
    "agree": {"ok": False, "reason": "rank 1 voted no"},
    "release": {"freed": True},
    "withdraw": {},
    "evict": {"evicted": [{"group": "g", "name": "default", "uid": 0}]},
    "hello": HELLO,
    "status": {**HELLO, "health": "healthy", "problems": [], "draining": False, "devices": []},
    "ls": {"groups": [], "more": False},
}


def test_every_op_has_a_well_formed_reply_here():
    assert set(OPS) == set(GOOD)


@pytest.mark.parametrize("op", sorted(GOOD))
def test_a_well_formed_reply_passes(op):
    check_reply(op, GOOD[op])


@pytest.mark.parametrize("op, body, named", [
    ("join", {**GOOD["join"], "sizes": [4096, "4096"]}, "'sizes'"),
    ("join", {k: v for k, v in GOOD["join"].items() if k != "handles"}, "'handles'"),
    ("commit", {"ok": 1, "reason": ""}, "'ok'"),
    ("release", {"freed": None}, "'freed'"),
    ("hello", {**HELLO, "pid": True}, "'pid'"),
    ("ls", [], "must be a map"),
])
def test_a_bad_reply_names_what_is_wrong(op, body, named):
    with pytest.raises(ProtocolError) as caught:
        check_reply(op, body)
    assert caught.value.code is ErrorCode.BAD_REQUEST and named in caught.value.message


def test_the_registrys_replies_fit_their_schemas():
    """The daemon's side: every reply body the registry builds passes the schema clients check."""
    from peerd.registry import Registry
    from tests.unit.test_groups import FakeMemory, agree, bodies, commit, join, release, who

    mem = FakeMemory()
    reg = Registry(mem.allocate, mem.free, rendezvous_timeout=10, agreement_timeout=10)
    replies = {
        "join": bodies(join(reg, 0, npes=1)),
        "commit": bodies(commit(reg, 0)),
        "release": bodies(release(reg, 0)),
        "agree": bodies(agree(reg, 0, npes=1)),
    }
    join(reg, 0, npes=2)
    replies["withdraw"] = bodies(reg.withdraw(("w", 0), who(100), {"group": "g", "name": "n", "rank": 0, "npes": 2,
                                                                "reason": "no"}, 0.0))
    _, evicted = reg.evict("g", None)
    replies["evict"] = {("e", 0): {"evicted": evicted}}
    for op, sent in replies.items():
        assert sent, op
        for body in sent.values():
            check_reply(op, body)
