"""The daemon's control pages (peerd.pages) driven through the registry's rules with fake memory."""

from __future__ import annotations

import logging
import os

import pytest

from peerd import controlpage as cp
from peerd.controlpage import PAGE_HANDLES, AbortCode, ControlPage, PageError
from peerd.pagearea import AREA_PAGES, Area
from peerd.fdroom import FdRoom
from peerd.pages import LEAVE_GRACE_S, SPARE_AREAS_PER_UID, Pages
from peerd.protocol import ErrorCode, ProtocolError
from peerd.registry import Registry
from peerd.rendezvous import COMMIT_LOOK_FIRST_S
from tests.unit.test_groups import FakeMemory, agree, bodies, commit, errors, join, release, who


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


_mapped: list[Area] = []  # members' mappings of areas, unmapped after each test


@pytest.fixture(autouse=True)
def unmap_members():
    yield
    while _mapped:
        _mapped.pop().close()


def opened(reg, npes=2, pids=(100, 101), name="n", uid=None, group="g") -> tuple:
    """A live set of ``group``, and where its page is: the join reply's ``page``."""
    for r in range(npes):
        out = reg.join(("c", r), who(pids[r], uid), {"group": group, "name": name, "rank": r, "npes": npes,
                                                      "nbytes": 64, "device": "d", "flags": 0, "timeout": None}, 0.0)
    replies = list(bodies(out).values())
    assert len(replies) == npes and all(b.get("page") == replies[0].get("page") for b in replies), replies
    for r in range(npes):
        reg.commit(("v", r), who(pids[r], uid), {"group": group, "name": name, "rank": r, "ok": True, "reason": "",
                                                 "timeout": None, "page": False}, 0.0)
    return reg.sets[(uid, group, name)], replies[0].get("page")


def member_view(pages, bset, location) -> ControlPage:
    """The page as a member finds it: in its own mapping of the area the fd channel sends
    (from a copy of the fd: the daemon keeps its own), at the join reply's offset."""
    handles, fds = pages.handout(bset)
    assert handles == PAGE_HANDLES
    _mapped.append(Area.attach(os.dup(fds[0])))
    area_id, offset, generation = location
    return _mapped[-1].page(offset, bset.npes, instance=pages.instance, generation=generation)


def test_a_set_gets_a_page_of_its_groups_area_when_its_handles_go_out(reg, pages):
    bset, location = opened(reg)
    area_id, offset, generation = location
    view = member_view(pages, bset, location)
    assert (view.instance, view.npes, view.generation) == (pages.instance, 2, bset.id) and generation == bset.id
    assert pages.handout(bset)[1][0] == pages.handout(bset)[1][0] and (len(pages), pages.areas) == (1, 1)
    assert os.fstat(pages.handout(bset)[1][0]).st_size == AREA_PAGES * cp.page_bytes(2)
    assert view.unmapped() == [0, 1] and view.aborted() is None, "a fresh page"


def test_sets_of_one_uid_share_an_area_whatever_their_group_until_it_is_full_and_other_uids_get_their_own(reg, pages):
    locations = [opened(reg, 1, pids=(100 + k,), name="s", group=f"g{k}")[1] for k in range(AREA_PAGES + 1)]
    assert len({loc[0] for loc in locations[:AREA_PAGES]}) == 1, "one uid's groups: one area, nothing to fetch again"
    assert locations[-1][0] != locations[0][0], "a full area: the next set gets a new one"
    assert len({loc[1] for loc in locations[:AREA_PAGES]}) == AREA_PAGES, "every page its own slot"
    wide = opened(reg, 64, pids=tuple(range(500, 564)), name="wide")[1]  # 64 ranks: two 4 KiB pages
    assert wide[0] not in {loc[0] for loc in locations}, "a page size of its own"
    theirs = opened(reg, 1, pids=(300,), name="s", group="g0", uid=1000)[1]
    assert theirs[0] not in {loc[0] for loc in locations + [wide]}, "another uid never shares an area"


def test_a_failed_set_aborts_the_pages_of_its_own_group_only_not_its_uids_other_groups_in_the_same_area(reg, pages):
    mine, here = opened(reg, 2, group="g")
    neighbour, there = opened(reg, 2, pids=(200, 201), group="h")
    assert here[0] == there[0], "one uid: one area"
    failing = {"group": "g", "name": "next", "npes": 2, "nbytes": 64, "device": "d", "flags": 0, "timeout": None}
    reg.join(("c", 0), who(100, None), {**failing, "rank": 0}, 0.0)
    reg.join(("c", 1), who(101, None), {**failing, "rank": 1}, 0.0)
    reg.commit(("v", 0), who(100, None), {"group": "g", "name": "next", "rank": 0, "ok": False, "reason": "no",
                                          "timeout": None, "page": False}, 0.0)
    assert member_view(pages, mine, here).aborted().code == AbortCode.SET_FAILED, "a set of its group failed"
    assert member_view(pages, neighbour, there).aborted() is None, "another group of the uid is untouched"


class NoScan(dict):
    """The daemon's page table, refusing to be walked: a failing set must look at its own group alone,
    not at every page of every user (one user failing sets in a loop cost the loop in proportion to them)."""

    def items(self):
        raise AssertionError("walked every page")

    values = keys = __iter__ = items


def test_a_failing_set_looks_at_its_own_groups_pages_alone(reg, pages):
    mine, here = opened(reg, 2, group="g")
    theirs, there = opened(reg, 2, pids=(200, 201), group="g", uid=1000)  # another uid's group of that name
    failing = {"group": "g", "name": "next", "npes": 2, "nbytes": 64, "device": "d", "flags": 0, "timeout": None}
    pages._pages = NoScan(pages._pages)
    try:
        reg.join(("c", 0), who(100, None), {**failing, "rank": 0}, 0.0)
        reg.withdraw(("c", 1), who(101, None), {"group": "g", "name": "next", "rank": 1, "npes": 2,
                                                "reason": "no GPU"}, 0.0)
    finally:
        pages._pages = dict(dict.items(pages._pages))
    assert member_view(pages, mine, here).aborted().code == AbortCode.SET_FAILED
    assert member_view(pages, theirs, there).aborted() is None, "another uid's group of the same name is untouched"


def test_an_eviction_aborts_the_page_before_any_memory_is_freed(reg, mem, pages):
    bset, location = opened(reg)
    view = member_view(pages, bset, location)
    seen = []
    free = mem.free

    def checked_free(allocation, mapped_by):
        seen.append(view.aborted())
        free(allocation, mapped_by)

    reg._sets._free = checked_free
    reg.evict("g", None)
    assert len(seen) == 2 and all(a is not None and a.code == AbortCode.EVICTED for a in seen), seen
    assert len(pages) == 0, "the daemon lets go of the page of a freed set"


@pytest.mark.parametrize("how, code", [("died", AbortCode.MEMBER_DIED), ("released", AbortCode.MEMBER_LEFT)])
def test_a_member_that_dies_or_leaves_aborts_its_peers_with_the_reason(reg, pages, how, code):
    bset, location = opened(reg)
    view = member_view(pages, bset, location)
    if how == "died":
        reg.process_died(101, 1.0)
    else:
        release(reg, 1)  # at time 0: see Note [A leaving rank aborts late]
        assert view.aborted() is None, "a peer's kernel launched before the release still finishes"
        reg.expire(LEAVE_GRACE_S)
    aborted = view.aborted()
    assert aborted.code == code and "rank 1 (pid 101)" in aborted.reason, aborted.reason


def test_a_failed_set_of_the_group_aborts_every_page_of_the_group_and_the_first_reason_stays(reg, pages):
    view = member_view(pages, *opened(reg))
    join(reg, 0, name="other")
    join(reg, 1, name="other", nbytes=128)  # a mismatch fails the other set of the group
    aborted = view.aborted()
    assert aborted.code == AbortCode.SET_FAILED and "nbytes=128" in aborted.reason
    reg.process_died(101, 1.0)
    assert view.aborted().code == AbortCode.SET_FAILED, "the first abort's reason is the cause"


def test_a_members_own_abort_stays_the_reason_when_the_daemon_aborts_the_page_after_it(reg, pages):
    """A member aborts its group's page itself where the daemon cannot see the cause (a peer it saw
    stopped); the daemon's later abort (that member released, died) must not write over the cause."""
    bset, location = opened(reg)
    view = member_view(pages, bset, location)
    view.abort(AbortCode.MEMBER_STOPPED, "rank 1 (pid 101), a peer of group=g name=n rank 0, has been stopped")
    reg.process_died(100, 1.0)
    aborted = member_view(pages, bset, location).aborted()
    assert aborted.code == AbortCode.MEMBER_STOPPED and "has been stopped" in aborted.reason, aborted.reason


def test_shutdown_aborts_every_page_and_closes_the_areas(reg, pages):
    view = member_view(pages, *opened(reg))
    pages.shutdown()
    assert view.aborted().code == AbortCode.SHUTDOWN and (len(pages), pages.areas) == (0, 0)


@pytest.mark.parametrize("end", ["evict", "shutdown"])
def test_an_eviction_or_a_shutdown_closes_an_opening_sets_commit_round_before_it_aborts(reg, pages, end):
    """The message ranks hear a failure; a page rank that wakes with every slot voted must not settle the
    round AGREED after the daemon gave up on the set, so the daemon settles it first (ABORTED)."""
    out = join(reg, 0) + join(reg, 1)
    bset = reg.sets[(None, "g", "n")]
    view = member_view(pages, bset, bodies(out)[("c", 0)]["page"])
    reg.evict("g", None) if end == "evict" else pages.shutdown()
    entry = cp.decode_verdict(view.word(cp.verdict_offset(cp.COMMIT_ROUND)).value)
    assert entry[1:] == (cp.Outcome.ABORTED, cp.DAEMON_RANK), "no rank can pass round 1 now"
    assert view.aborted().code == (AbortCode.EVICTED if end == "evict" else AbortCode.SHUTDOWN)


def test_an_eviction_of_a_live_set_leaves_its_agreed_commit_round_as_it_was(reg, pages):
    bset, location = opened(reg)
    view = member_view(pages, bset, location)
    agreed = cp.encode_verdict(cp.COMMIT_ROUND, cp.Outcome.AGREED, 1)
    view.word(cp.verdict_offset(cp.COMMIT_ROUND)).value = agreed  # as the ranks settled it
    reg.evict("g", None)
    assert view.word(cp.verdict_offset(cp.COMMIT_ROUND)).value == agreed


def test_a_page_that_cannot_be_made_leaves_the_set_without_one_with_one_warning(reg, pages, monkeypatch, caplog):
    def no_memfd(*args, **kwargs):
        raise PageError("memfd_create failed: [Errno 24] Too many open files")

    monkeypatch.setattr(Area, "create", no_memfd)
    with caplog.at_level(logging.WARNING, "peerd.pages"):
        bset, location = opened(reg)
    assert location is None, "the join reply names no page: the group keeps the message path"
    assert len([r for r in caplog.records if "gets no control page" in r.message and "Too many" in r.message]) == 1
    with pytest.raises(ProtocolError) as refused:
        pages.handout(bset)
    assert refused.value.code is ErrorCode.ALLOCATION_FAILED and "its log says why" in refused.value.message


def test_a_commit_on_the_page_is_not_answered_and_a_commit_by_message_is_voted_on_the_page_for_its_rank(
        reg, pages):
    """The commit is the page's round 1: ranks that hold the page vote there and wait there; the
    daemon writes the vote of a rank that committed through a message, so they count it too."""
    out = join(reg, 0) + join(reg, 1)
    location = bodies(out)[("c", 0)]["page"]
    bset = reg.sets[(None, "g", "n")]
    view = member_view(pages, bset, location)
    assert commit(reg, 1) == [], "rank 1, without the page, waits for rank 0"
    assert view.word(cp.slot_offset(1)).value == cp.COMMIT_ROUND, "rank 1's vote is on the page"
    assert view.word(cp.slot_offset(1) + cp.OFF_VOTES).value == 1 << (cp.COMMIT_ROUND % 2), "and it says yes"
    # rank 0 votes on the page itself, and posts once its round agreed: that settles the set
    view.word(cp.verdict_offset(cp.COMMIT_ROUND)).value = cp.encode_verdict(cp.COMMIT_ROUND, cp.Outcome.AGREED, 0)
    assert bodies(commit(reg, 0, page=True)) == {("v", 1): {"ok": True, "reason": ""}}, "only rank 1 is answered"
    assert view.word(cp.slot_offset(0)).value == 0, "the daemon writes no vote for a rank that votes itself"
    assert bset.state.name == "LIVE" and view.aborted() is None


def test_a_post_that_the_page_does_not_confirm_settles_nothing_and_a_peers_no_still_fails_the_set(reg, pages):
    """A member's post says its round on the page agreed; the daemon believes it only where the
    page says so, so a member that posts yes without voting cannot make the set live over a peer
    that could not map it (the peer's no fails the set, and that is what the peer is told)."""
    out = join(reg, 0) + join(reg, 1)
    bset = reg.sets[(None, "g", "n")]
    view = member_view(pages, bset, bodies(out)[("c", 0)]["page"])
    assert commit(reg, 0, page=True) == [] and bset.state.name == "OPENING", "the round never agreed on the page"
    answered = bodies(commit(reg, 1, ok=False, reason="cannot map peer 0"))
    assert answered == {("v", 1): {"ok": False, "reason": "rank 1: cannot map peer 0"}}
    assert bset.state.name == "FAILED" and view.aborted().code == AbortCode.SET_FAILED


def test_a_set_whose_commit_agreed_on_the_page_goes_live_at_the_daemons_look_with_no_post(reg, pages):
    """Its ranks tell the daemon only a no: a yes is read off the page, first COMMIT_LOOK_FIRST_S after
    the handles went out, then at doubling intervals while the round is open, until it agreed."""
    out = join(reg, 0) + join(reg, 1)
    bset = reg.sets[(None, "g", "n")]
    view = member_view(pages, bset, bodies(out)[("c", 0)]["page"])
    assert reg.next_deadline() == pytest.approx(COMMIT_LOOK_FIRST_S)
    assert reg.expire(COMMIT_LOOK_FIRST_S) == [] and bset.state.name == "OPENING", "the ranks have not voted yet"
    assert reg.next_deadline() == pytest.approx(3 * COMMIT_LOOK_FIRST_S), "the next look, twice as long after"
    view.word(cp.verdict_offset(cp.COMMIT_ROUND)).value = cp.encode_verdict(cp.COMMIT_ROUND, cp.Outcome.AGREED, 0)
    assert reg.expire(3 * COMMIT_LOOK_FIRST_S) == [] and bset.state.name == "LIVE"
    assert reg.next_deadline() is None or reg.next_deadline() > 100, "no more looks once it is live"


def test_a_yes_by_message_beside_page_voters_is_answered_once_the_round_agrees_on_the_page(reg, pages):
    """A rank without the page votes through a message and waits for the verdict; its peers on the page
    post nothing, so the daemon looks at the page soon after the message's vote lands there."""
    out = join(reg, 0) + join(reg, 1)
    bset = reg.sets[(None, "g", "n")]
    view = member_view(pages, bset, bodies(out)[("c", 0)]["page"])
    for look in range(12):  # the looks have grown far apart before the message comes
        reg.expire(2.0 ** look)
    assert commit(reg, 1, now=5000.0) == [] and view.word(cp.slot_offset(1)).value == cp.COMMIT_ROUND
    view.word(cp.verdict_offset(cp.COMMIT_ROUND)).value = cp.encode_verdict(cp.COMMIT_ROUND, cp.Outcome.AGREED, 0)
    assert bodies(reg.expire(5000.0 + COMMIT_LOOK_FIRST_S)) == {("v", 1): {"ok": True, "reason": ""}}
    assert bset.state.name == "LIVE"


@pytest.mark.parametrize("agreed", [True, "and the ring went round", False])
def test_an_opening_set_whose_commit_agreed_on_the_page_is_live_though_a_post_never_came(reg, pages, agreed):
    """Its ranks went on: a rank that dies (or stalls past the commit timeout) after its vote on the
    page and before its post is a live set's member dying, even once the ranks' tp_agree rounds went
    once round the verdict ring, over the commit round's entry (every rank voting in a later round
    says the commit agreed: no rank votes on a page whose commit failed). Where the round had not
    agreed, the daemon closes it (ABORTED) before it fails the set, so no rank can pass it after."""
    out = join(reg, 0) + join(reg, 1)
    bset = reg.sets[(None, "g", "n")]
    view = member_view(pages, bset, bodies(out)[("c", 0)]["page"])
    if agreed:
        view.word(cp.verdict_offset(cp.COMMIT_ROUND)).value = cp.encode_verdict(cp.COMMIT_ROUND, cp.Outcome.AGREED, 1)
    if agreed == "and the ring went round":
        later = cp.COMMIT_ROUND + cp.RING
        view.word(cp.verdict_offset(later)).value = cp.encode_verdict(later, cp.Outcome.AGREED, 0)
        for rank in (0, 1):
            view.word(cp.slot_offset(rank)).value = later
    reg.process_died(101, 1.0)  # rank 1, before its post (and rank 0's not read yet)
    entry = cp.decode_verdict(view.word(cp.verdict_offset(cp.COMMIT_ROUND)).value)
    if agreed:
        assert bset.state.name == "LIVE", "the ranks went on with it"
        assert view.aborted().code == AbortCode.MEMBER_DIED and "rank 1 (pid 101)" in view.aborted().reason
    else:
        assert bset.state.name == "FAILED" and "died before it mapped its peers" in view.aborted().reason
        assert entry[1:] == (cp.Outcome.ABORTED, cp.DAEMON_RANK), "closed: no rank passes it now"


@pytest.mark.parametrize("page", [False, True])
def test_a_no_fails_the_set_at_once_and_aborts_the_page_with_its_reason(reg, pages, page):
    """By message (a rank that could not map a peer) or posted from the page (its round timed out)."""
    out = join(reg, 0) + join(reg, 1)
    view = member_view(pages, reg.sets[(None, "g", "n")], bodies(out)[("c", 0)]["page"])
    answered = bodies(commit(reg, 1, ok=False, reason="cudaIpcOpenMemHandle failed", page=page))
    assert answered == ({} if page else {("v", 1): {"ok": False, "reason": "rank 1: cudaIpcOpenMemHandle failed"}})
    assert view.word(cp.slot_offset(1)).value == 0, "a no is never written as a vote: the abort carries it"
    aborted = view.aborted()
    assert aborted is not None and aborted.code == AbortCode.SET_FAILED, "rank 0 waits on the page: it hears now"
    assert "rank 1: cudaIpcOpenMemHandle failed" in aborted.reason, aborted.reason
    assert reg.sets[(None, "g", "n")].state.name == "FAILED"
    assert bodies(commit(reg, 0)) == {("v", 0): {"ok": False, "reason": "rank 1: cudaIpcOpenMemHandle failed"}}


def test_a_commit_on_the_page_of_a_set_without_one_is_refused():
    mem = FakeMemory()
    reg = Registry(mem.allocate, mem.free, rendezvous_timeout=10, agreement_timeout=10)  # no pages
    join(reg, 0), join(reg, 1)
    refused = errors(commit(reg, 0, page=True))[("v", 0)]
    assert refused.code == ErrorCode.BAD_REQUEST and "has no control page to commit on" in refused.message


def test_a_daemon_with_pages_off_places_none_refuses_the_request_and_the_request_names_its_slot():
    pages = Pages(enabled=False)
    try:
        assert pages.split_request({"group": "g", "name": "n", "rank": 0, "page": True}) == (
            True, {"group": "g", "name": "n", "rank": 0})
        assert pages.split_request({"group": "g", "name": "n", "rank": 0}) == (False, {"group": "g", "name": "n",
                                                                                        "rank": 0})
        reg = Registry(FakeMemory().allocate, FakeMemory().free, rendezvous_timeout=10, agreement_timeout=10,
                       pages=pages)
        assert opened(reg)[1] is None
        with pytest.raises(ProtocolError, match="--control-pages false"):
            pages.handout(None)
    finally:
        pages.shutdown()


def test_a_freed_slot_is_reused_zeroed(reg, pages):
    bset, first = opened(reg)
    view = member_view(pages, bset, first)
    view.mark_mapped(0)
    view.word(cp.slot_offset(1)).value = 7  # a round, as a vote leaves it
    view.word(cp.verdict_offset(7)).value = cp.encode_verdict(7, cp.Outcome.AGREED, 1)
    release(reg, 0)
    release(reg, 1)
    assert view.aborted() is not None, "freed: the old page is aborted until its slot is taken again"
    bset, again = opened(reg)
    assert again[:2] == first[:2] and again[2] == bset.id != first[2], "the same slot, for the new set"
    fresh = member_view(pages, bset, again)
    assert fresh.aborted() is None and fresh.unmapped() == [0, 1]
    assert all(fresh.word(cp.slot_offset(r)).value == cp.COMMIT_ROUND for r in range(2)), \
        "every rank's round is the commit vote the daemon wrote for it (it committed by message), not 7"
    assert all(fresh.word(cp.verdict_offset(k)).value == 0 for k in range(cp.RING)), "no verdict is left"


def test_an_evicted_sets_slot_is_not_reused_while_a_process_it_was_handed_to_lives(reg, pages):
    """Note [A slot outlives its evicted set]."""
    bset, evicted = opened(reg, pids=(100, 101))
    view = member_view(pages, bset, evicted)
    reg.evict("g", None)
    reg.process_died(101, 1.0)  # a holder that died already waits on nothing
    pages.process_gone(101)
    bset, other = opened(reg, pids=(200, 201))
    assert other[1] != evicted[1], "pid 100 lives: the slot stays retired"
    assert view.aborted().code == AbortCode.EVICTED, "and keeps its abort"
    for pid in (200, 201):
        release(reg, 0 if pid == 200 else 1, pid=pid)
    pages.process_gone(100)
    assert view.aborted() is not None
    bset, after = opened(reg, pids=(300, 301))
    assert after[1] in (evicted[1], other[1]) and member_view(pages, bset, after).aborted() is None
    taken = {after[1]}
    bset, next_one = opened(reg, pids=(400, 401), name="m")
    assert {next_one[1]} | taken == {evicted[1], other[1]}, "both slots are free again"


def test_an_area_is_closed_once_every_slot_is_free_and_every_process_it_was_handed_to_exited(reg, pages):
    bset, location = opened(reg)
    release(reg, 0)
    release(reg, 1)
    assert pages.areas == 1, "its processes may map it still: the next set of theirs needs no fd"
    pages.process_gone(100)
    assert pages.areas == 1
    assert list(pages._of_pid) == [101], "a death looks at the areas of its pid alone: only 101's is left"
    pages.process_gone(101)
    assert pages.areas == 0 and pages._of_pid == {}


def test_an_area_the_daemon_closes_is_punched_out_first_so_a_kept_fd_holds_none_of_its_memory(reg, pages):
    bset, _ = opened(reg)
    kept = os.dup(pages.handout(bset)[1][0])  # as a member may keep the fd it was handed
    try:
        assert os.fstat(kept).st_blocks > 0, "the daemon formatted a page in it"
        release(reg, 0)
        release(reg, 1)
        pages.process_gone(100)
        pages.process_gone(101)
        assert pages.areas == 0
        assert os.fstat(kept).st_blocks == 0, "the closed area's pages went with it"
    finally:
        os.close(kept)


def test_a_process_cycling_through_group_names_is_served_from_one_area(reg, pages):
    """Every group of a uid has its pages in the uid's area: a process that makes set after set of new
    groups maps one area, and the daemon holds one."""
    areas = set()
    for k in range(SPARE_AREAS_PER_UID + 5):
        areas.add(opened(reg, 1, pids=(100,), group=f"g{k}", uid=1000)[1][0])
        reg.release(("r", 0), who(100, 1000), {"group": f"g{k}", "name": "n", "rank": 0}, 0.0)
    assert len(areas) == 1 and pages.areas == 1


def test_a_uid_that_filled_many_areas_keeps_only_a_few_unused_ones_open(reg, pages, caplog):
    """An area stays open while a process it was handed lives, for the uid's next sets, but per uid only
    SPARE_AREAS_PER_UID unused ones: the oldest closes, so a uid that once held many sets at once does
    not leave the daemon an fd and a mapping per area it filled."""
    caplog.set_level(logging.INFO, logger="peerd.pages")
    filled = SPARE_AREAS_PER_UID + 2
    names = [f"s{k}" for k in range(filled * AREA_PAGES)]
    areas = [opened(reg, 1, pids=(100,), name=name, uid=1000)[1][0] for name in names]
    assert len(set(areas)) == filled and pages.areas == filled
    for name in names:
        reg.release(("r", 0), who(100, 1000), {"group": "g", "name": name, "rank": 0}, 0.0)
    assert pages.areas == SPARE_AREAS_PER_UID
    assert "the oldest of more than" in caplog.text
    assert opened(reg, 1, pids=(100,), name="again", uid=1000)[1][0] in areas[-SPARE_AREAS_PER_UID * AREA_PAGES:], \
        "the uid's next set takes a spare its process maps"
    reg.release(("r", 0), who(100, 1000), {"group": "g", "name": "again", "rank": 0}, 0.0)
    opened(reg, 1, pids=(200,), group="other", uid=2000)
    reg.release(("r", 0), who(200, 2000), {"group": "other", "name": "n", "rank": 0}, 0.0)
    assert pages.areas == SPARE_AREAS_PER_UID + 1, "another uid's spare is not counted against this one's"
    pages.process_gone(200)
    assert pages.areas == SPARE_AREAS_PER_UID


def test_areas_fill_at_most_their_share_of_the_fd_room_and_a_set_past_it_agrees_by_messages(mem, caplog):
    room = FdRoom(4)
    pages = Pages(room=room)
    reg = Registry(mem.allocate, mem.free, rendezvous_timeout=10, agreement_timeout=10, pages=pages)
    try:
        placed = [opened(reg, 1, pids=(100 + k,), uid=1000 + k)[1] for k in range(3)]  # an area per uid
        assert [p is not None for p in placed] == [True, True, False] and room.used == 2, "half the room"
        assert "file descriptors its limit leaves beside its connections" in caplog.text
        reg.release(("r", 0), who(100, 1000), {"group": "g", "name": "n", "rank": 0}, 0.0)
        pages.process_gone(100)
        assert room.used == 1, "a closed area gives its place back"
    finally:
        pages.shutdown()
    assert room.used == 0


def test_on_the_message_path_a_vote_after_an_eviction_is_false_until_the_pid_joins_again(reg):
    opened(reg)
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

    opened(reg)
    reg.evict("g", None)
    agree(reg, 1, group="g")
    assert bodies(agree(reg, 0, group="g"))[("a", 0)]["ok"] is False


def test_when_every_rank_leaves_within_the_grace_nobody_hears_a_departure(reg, pages):
    """Note [A leaving rank aborts late]: the normal end of a job, every rank closing at once."""
    view = member_view(pages, *opened(reg))
    release(reg, 1)
    release(reg, 0)
    reg.expire(LEAVE_GRACE_S)
    assert view.aborted().code == AbortCode.SET_FAILED and "freed" in view.aborted().reason  # closed, not left
