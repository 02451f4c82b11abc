"""The daemon's control pages (peerd.pages) driven through the registry's rules with fake memory."""

from __future__ import annotations

import logging
import os

import pytest

from peerd.controlpage import PAGE_HANDLES, AbortCode, ControlPage, PageError
from peerd.pages import LEAVE_GRACE_S, Pages
from peerd.protocol import ErrorCode, ProtocolError
from peerd.registry import Registry
from tests.unit.test_groups import FakeMemory, join, live_set, release


@pytest.fixture
def pages():
    p = Pages()
    yield p
    p.shutdown()


@pytest.fixture
def mem():
    return FakeMemory()


@pytest.fixture
def reg(mem, pages):
    return Registry(mem.allocate, mem.free, rendezvous_timeout=10, agreement_timeout=10, pages=pages)


def member_view(pages, bset) -> ControlPage:
    """The page as a member maps it: from a copy of the fd the fd channel sends (the daemon keeps its own)."""
    handles, fds = pages.handout(bset)
    assert handles == PAGE_HANDLES
    return ControlPage.attach(os.dup(fds[0]), npes=bset.npes, instance=pages.instance, generation=bset.id)


def test_one_page_per_set_made_for_this_daemon_run(reg, pages):
    bset = live_set(reg)
    first, second = member_view(pages, bset), member_view(pages, bset)
    assert first.instance == pages.instance and first.generation == bset.id
    assert pages.handout(bset)[1][0] == pages.handout(bset)[1][0] and len(pages) == 1
    first.close()
    second.close()


def test_an_eviction_aborts_the_page_before_any_memory_is_freed(reg, mem, pages):
    bset = live_set(reg)
    view = member_view(pages, bset)
    seen = []
    free = mem.free

    def checked_free(allocation):
        seen.append(view.aborted())
        free(allocation)

    reg._sets._free = checked_free
    reg.evict("g", None)
    assert len(seen) == 2 and all(a is not None and a.code == AbortCode.EVICTED for a in seen), seen
    assert len(pages) == 0, "the daemon closes the page of a freed set"
    view.close()


@pytest.mark.parametrize("how, code", [("died", AbortCode.MEMBER_DIED), ("released", AbortCode.MEMBER_LEFT)])
def test_a_member_that_dies_or_leaves_aborts_its_peers_with_the_reason(reg, pages, how, code):
    bset = live_set(reg)
    view = member_view(pages, bset)
    if how == "died":
        reg.process_died(101, 1.0)
    else:
        release(reg, 1)  # at time 0: see Note [A leaving rank aborts late]
        assert view.aborted() is None, "a peer's kernel launched before the release still finishes"
        reg.expire(LEAVE_GRACE_S)
    aborted = view.aborted()
    assert aborted.code == code and "rank 1 (pid 101)" in aborted.reason, aborted.reason
    view.close()


def test_a_failed_set_of_the_group_aborts_every_page_of_the_group_and_the_first_reason_stays(reg, pages):
    view = member_view(pages, live_set(reg))
    join(reg, 0, name="other")
    join(reg, 1, name="other", nbytes=128)  # a mismatch fails the other set of the group
    aborted = view.aborted()
    assert aborted.code == AbortCode.SET_FAILED and "nbytes=128" in aborted.reason
    reg.process_died(101, 1.0)
    assert view.aborted().code == AbortCode.SET_FAILED, "the first abort's reason is the cause"
    view.close()


def test_shutdown_aborts_every_page_and_closes_them(reg, pages):
    view = member_view(pages, live_set(reg))
    pages.shutdown()
    assert view.aborted().code == AbortCode.SHUTDOWN and len(pages) == 0
    view.close()


def test_a_page_that_cannot_be_made_is_refused_with_one_warning(reg, pages, monkeypatch, caplog):
    def no_memfd(*args, **kwargs):
        raise PageError("memfd_create failed: [Errno 24] Too many open files")

    monkeypatch.setattr(ControlPage, "create", no_memfd)
    bset = live_set(reg)
    with caplog.at_level(logging.WARNING, "peerd.pages"):
        for _ in range(bset.npes):  # every rank asks; the daemon tries and warns once
            with pytest.raises(ProtocolError) as refused:
                pages.handout(bset)
            assert refused.value.code is ErrorCode.ALLOCATION_FAILED and "Too many open files" in refused.value.message
    assert len([r for r in caplog.records if "gets no control page" in r.message]) == 1


def test_a_daemon_with_pages_off_refuses_the_request_and_the_request_names_its_slot():
    pages = Pages(enabled=False)
    try:
        assert pages.split_request({"group": "g", "name": "n", "rank": 0, "page": True}) == (
            True, {"group": "g", "name": "n", "rank": 0})
        assert pages.split_request({"group": "g", "name": "n", "rank": 0}) == (False, {"group": "g", "name": "n",
                                                                                        "rank": 0})
        with pytest.raises(ProtocolError, match="--control-pages false"):
            pages.handout(None)
    finally:
        pages.shutdown()


def test_on_the_message_path_a_vote_after_an_eviction_is_false_until_the_pid_joins_again(reg):
    from tests.unit.test_groups import agree, bodies, commit

    live_set(reg)
    for r in (0, 1):
        agree(reg, r, group="g")
    reg.evict("g", None)
    late = bodies(agree(reg, 0, group="g"))
    assert late == {("a", 0): {"ok": False, "reason": "group=g was evicted by an administrator: "
                                                      "build the PeerBuffer again"}}
    for r in (0, 1):  # the same pids build a new set of the group: their rounds pass again
        join(reg, r)
    for r in (0, 1):
        commit(reg, r)
    agree(reg, 0, group="g")
    assert bodies(agree(reg, 1, group="g"))[("a", 1)] == {"ok": True, "reason": ""}


def test_on_the_message_path_a_holder_that_never_voted_gets_false_after_an_eviction(reg):
    """The evicted set's holders are barred too, not only the pids that had voted before it."""
    from tests.unit.test_groups import agree, bodies

    live_set(reg)
    reg.evict("g", None)
    agree(reg, 1, group="g")
    assert bodies(agree(reg, 0, group="g"))[("a", 0)]["ok"] is False


def test_when_every_rank_leaves_within_the_grace_nobody_hears_a_departure(reg, pages):
    """Note [A leaving rank aborts late]: the normal end of a job, every rank closing at once."""
    view = member_view(pages, live_set(reg))
    release(reg, 1)
    release(reg, 0)
    reg.expire(LEAVE_GRACE_S)
    assert view.aborted().code == AbortCode.SET_FAILED and "freed" in view.aborted().reason  # closed, not left
    view.close()
