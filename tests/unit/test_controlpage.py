"""The control page in one process: layout, write order, aborts, instances,
timeouts and futex wakes (ranks as threads; the processes are in
tests/integration/test_controlpage_agree.py)."""

from __future__ import annotations

import ctypes
import fcntl
import os
import signal
import threading
import time

import pytest

from peerd import controlpage as cp
from peerd.controlpage import AbortCode, ControlPage, GroupAborted, Outcome, PageError, StaleInstance
from peerd.pagearea import Area
from peerd.pageagree import PageVoter
from tests.pagekit import OwnPage


@pytest.fixture
def pages():
    made = []

    def make(npes: int, instance: int = 0x1234) -> OwnPage:
        made.append(OwnPage(npes, instance, generation=7))
        return made[-1]

    yield make
    for p in made:
        p.close()


def twin(page: OwnPage) -> ControlPage:
    """The same page mapped a second time, as another member maps it."""
    return page.twin()


@pytest.mark.parametrize("npes", [1, 2, 8, 63, 1024])
def test_every_field_has_its_own_place_and_every_slot_its_own_cache_line(npes):
    fields = [(cp.OFF_MAGIC, 8), (cp.OFF_VERSION, 8), (cp.OFF_INSTANCE, 8), (cp.OFF_NPES, 8),
              (cp.OFF_GENERATION, 8), (cp.OFF_WAKE, 4), (cp.OFF_SLEEPERS, 4), (cp.OFF_ABORT, 8),
              (cp.OFF_REASON, cp.REASON_BYTES), (cp.OFF_VERDICTS, 8 * cp.RING)]
    fields += [(cp.slot_offset(r), cp.SLOT_BYTES) for r in range(npes)]
    ends = sorted((start, start + size) for start, size in fields)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ends, ends[1:])), "no two fields overlap"
    assert all(start % min(size, 8) == 0 for start, size in fields), "every word is naturally aligned"
    assert all(cp.slot_offset(r) % 64 == 0 for r in range(npes))
    assert cp.OFF_ABORT // 64 not in {cp.OFF_WAKE // 64, cp.slot_offset(0) // 64}, "the abort word has its own line"
    assert cp.page_bytes(npes) >= ends[-1][1] and cp.page_bytes(npes) % os.sysconf("SC_PAGE_SIZE") == 0


def test_the_header_says_what_made_the_page_and_a_member_checks_it(pages):
    page = pages(4, instance=0xABCDEF)
    other = twin(page)
    assert (other.version, other.instance, other.npes, other.generation) == (cp.VERSION, 0xABCDEF, 4, 7)
    area = page.area
    with pytest.raises(PageError, match="npes=4, this group has npes=2"):
        area.page(0, 2)
    with pytest.raises(PageError, match="set generation 7, not 8"):
        area.page(0, 4, generation=8)
    with pytest.raises(StaleInstance, match="daemon instance 0xabcdef, but the daemon now is instance 0x1"):
        area.page(0, 4, instance=1)
    with pytest.raises(PageError, match="not inside the"):
        area.page(cp.page_bytes(4), 4)
    fd = os.memfd_create("not-a-page")
    os.ftruncate(fd, 4096)
    stranger = Area.attach(fd)
    with pytest.raises(PageError, match=f"holds no version-{cp.VERSION} control page"):
        stranger.page(0, 1)
    stranger.close()


def test_an_area_holds_its_pages_apart_and_a_member_holds_no_fd_of_it():
    size = cp.page_bytes(2)
    area = Area.create(size, slots=3)
    member = Area.attach(os.dup(area.fd))
    assert member.fd == -1 and area.size == member.size == 3 * size
    for k in range(3):
        area.page_at(k * size, size).format(2, 0x99, generation=k)
    seen = [member.page(k * size, 2, instance=0x99, generation=k) for k in range(3)]
    seen[1].abort(AbortCode.EVICTED, "only set 1")
    assert [p.aborted() is not None for p in seen] == [False, True, False]
    area.page_at(size, size).format(2, 0x99, generation=3)  # the slot reused: zeroed, a fresh header
    fresh = member.page(size, 2, instance=0x99, generation=3)
    assert fresh.aborted() is None and fresh.unmapped() == [0, 1]
    member.close()
    area.close()


def test_no_member_can_resize_the_area(pages):
    page = pages(2)
    with pytest.raises(PermissionError):
        os.ftruncate(page.fd, 0)  # a shrunk area would SIGBUS every process that maps it
    assert fcntl.fcntl(page.fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SEAL


def test_a_vote_writes_the_vote_bit_then_the_round(pages):
    page = pages(1)
    voter = PageVoter(page, 0)
    for k, ok in enumerate([True, False, False, True], start=1):
        assert voter.agree(ok, time.monotonic() + 5).ok is ok
        votes = page.word(cp.slot_offset(0) + 8).value
        assert page.word(cp.slot_offset(0)).value == k
        assert bool(votes & 1 << (k % 2)) is ok, "this round's vote sits in bit k % 2"
        assert cp.decode_verdict(page.word(cp.verdict_offset(k)).value)[:2] == (k, Outcome.AGREED if ok else
                                                                                Outcome.VOTED_NO)
    assert votes & 1 << 1 == 0, "the previous round's vote is kept in the other bit"
    with pytest.raises(ValueError, match="rank 1 is out of range"):
        PageVoter(page, 1)


def test_an_abort_carries_its_whole_reason_and_check_raises_it(pages):
    page = pages(2)
    other = twin(page)
    assert other.aborted() is None and other.aborted_at is None
    other.check()
    before = time.monotonic()
    page.abort(AbortCode.SHUTDOWN, "peerd is shutting down (SIGTERM)")
    assert before <= other.aborted_at <= time.monotonic(), "the instant is time.monotonic's, shared by processes"
    with pytest.raises(GroupAborted, match=r"aborted \(SHUTDOWN\): peerd is shutting down \(SIGTERM\)") as err:
        other.check()
    assert err.value.code == AbortCode.SHUTDOWN
    assert ctypes.c_uint64.from_address(other.abort_address).value & 0xFFFF == AbortCode.SHUTDOWN
    ctypes.memmove(page.address + cp.OFF_REASON, b"garbage", 7)  # a member writing over the text
    assert "its reason was overwritten" in other.aborted().reason
    long = pages(2)
    long.abort(AbortCode.EVICTED, "é" * 400)  # cut to the text area, never inside a character
    assert twin(long).aborted().reason.endswith("é" * 127)


def test_the_first_abort_wins_and_its_reason_stands(pages):
    """Two ranks that saw the same peer stopped both abort: the second writes nothing, so no reader
    ever finds the first one's text written over (a GPU test read 'its reason was overwritten')."""
    page = pages(2)
    other = twin(page)
    assert page.abort(AbortCode.MEMBER_STOPPED, "rank 1 (pid 7) was stopped, seen by rank 0")
    assert not other.abort(AbortCode.MEMBER_STOPPED, "rank 1 (pid 7) was stopped, seen by rank 2")
    assert not page.abort(AbortCode.SHUTDOWN, "peerd is shutting down")
    aborted = other.aborted()
    assert aborted.code == AbortCode.MEMBER_STOPPED and aborted.reason.endswith("seen by rank 0"), aborted


def test_an_aborter_stopped_between_its_claim_and_its_reason_leaves_the_code(pages):
    """The claim is already the abort (kernels and rounds test the word for non-zero); a reader waits
    ABORT_TEXT_WAIT_S for the reason, then reports the code alone, and nobody else may write one."""
    page = pages(2)
    claim = cp.WRITING << 16 | AbortCode.MEMBER_DIED
    page.word(cp.OFF_ABORT).value = claim
    began = time.monotonic()
    aborted = twin(page).aborted()
    assert time.monotonic() - began >= cp.ABORT_TEXT_WAIT_S
    assert aborted.code == AbortCode.MEMBER_DIED and "stopped before it wrote the reason" in aborted.reason
    assert page.aborted_at is None, "no instant was written, and none is made up"
    assert not page.abort(AbortCode.SHUTDOWN, "peerd is shutting down")
    assert page.word(cp.OFF_ABORT).value == claim


def test_a_timed_out_round_is_false_for_the_late_rank_and_the_next_round_agrees(pages):
    page = pages(2)
    early, late = PageVoter(page, 0, label="group=g"), PageVoter(twin(page), 1, label="group=g")
    gave_up = early.agree(True, time.monotonic() + 0.05)
    assert gave_up == cp.Verdict(False, "agreement round 1 of group=g timed out waiting for rank(s) [1]")
    later = late.agree(True, time.monotonic() + 600)  # round 1 settled: no wait, False
    assert later.ok is False and "rank 0 stopped waiting before every rank voted" in later.reason
    both = {}
    t = threading.Thread(target=lambda: both.setdefault(0, early.agree(True, time.monotonic() + 600)))
    t.start()
    both[1] = late.agree(True, time.monotonic() + 600)
    t.join(60)
    assert both == {0: cp.Verdict(True), 1: cp.Verdict(True)}, "round 2 agrees normally"


def test_a_round_the_daemon_closed_reads_the_reason_of_the_abort_it_writes_next(pages):
    """The daemon closes a commit round (is the set failing?), then aborts the page with the cause:
    a rank that saw the round closed in between waits for that cause instead of a bare "aborted"."""
    page = pages(2)
    voter = PageVoter(twin(page), 0, label="group=g")
    assert not page.close_round(1)
    later = threading.Timer(0.05, page.abort, (AbortCode.MEMBER_DIED, "rank 1 (pid 4242) died"))
    later.start()
    verdict = voter.agree(True, time.monotonic() + 600)
    later.join()
    assert verdict == cp.Verdict(False, "agreement round 1 of group=g ended: the group was aborted "
                                        "(MEMBER_DIED): rank 1 (pid 4242) died"), verdict


def test_a_rank_far_behind_finds_its_round_forgotten(pages):
    page = pages(2)
    voter = PageVoter(page, 1)
    page.word(cp.verdict_offset(1)).value = cp.encode_verdict(1 + cp.RING, Outcome.TIMED_OUT, 0)
    verdict = voter.agree(True, time.monotonic() + 600)
    assert verdict.ok is False and f"more than {cp.RING} rounds behind" in verdict.reason


@pytest.fixture
def no_slices(monkeypatch):
    """Sleepers wait for their wake alone: a lost wake would hang the test, not end a 50 ms slice."""
    monkeypatch.setattr("peerd.pageagree.WAIT_SLICE_S", 600.0)


def test_an_abort_wakes_a_sleeping_waiter_and_every_later_round_is_false(pages, no_slices):
    page = pages(2)
    waiter = PageVoter(twin(page), 0, spin_s=0)
    got = []
    t = threading.Thread(target=lambda: got.append(waiter.agree(True, time.monotonic() + 600)))
    t.start()
    while not ctypes.c_uint32.from_address(page.address + cp.OFF_SLEEPERS).value:  # inside FUTEX_WAIT
        time.sleep(0.001)
    page.abort(AbortCode.MEMBER_DIED, "rank 1 (pid 4242) died")
    t.join(60)
    assert not t.is_alive()
    assert got[0].ok is False and "rank 1 (pid 4242) died" in got[0].reason
    assert "MEMBER_DIED" in waiter.agree(True, time.monotonic() + 600).reason


def test_a_publish_wakes_a_sleeper_and_it_answers_the_and(pages, no_slices):
    page = pages(2)
    sleeper, voter = PageVoter(twin(page), 0, spin_s=0), PageVoter(page, 1)
    got = []
    t = threading.Thread(target=lambda: got.append(sleeper.agree(True, time.monotonic() + 600)))
    t.start()
    while not ctypes.c_uint32.from_address(page.address + cp.OFF_SLEEPERS).value:
        time.sleep(0.001)
    assert voter.agree(False, time.monotonic() + 600) == cp.Verdict(False, "agreement round 1 of this group: "
                                                                           "rank(s) [1] voted no")
    t.join(60)
    assert not t.is_alive(), "the last vote woke the sleeper"
    assert got == [cp.Verdict(False, "agreement round 1 of this group: rank(s) [1] voted no")]
    assert ctypes.c_uint32.from_address(page.address + cp.OFF_SLEEPERS).value == 0


def test_reasons_number_the_rounds_after_the_commit_vote_as_tp_agree_calls(pages):
    """A buffer set's page holds its commit vote as round 1: its voters' first tp_agree call is round 2 there,
    and its reason says "agreement round 1", the caller's first call."""
    page = pages(2)
    first, second = (PageVoter(p, r, "group=g", commit_rounds=cp.COMMIT_ROUND) for r, p in enumerate((page, twin(page))))
    verdicts = []
    for ok in (True, False):
        t = threading.Thread(target=lambda o=ok: verdicts.append(second.agree(o, time.monotonic() + 600)))
        t.start()
        verdicts.append(first.agree(True, time.monotonic() + 600))
        t.join(60)
    assert verdicts[:2] == [cp.Verdict(True)] * 2
    assert verdicts[2:] == [cp.Verdict(False, "agreement round 1 of group=g: rank(s) [1] voted no")] * 2


def test_a_round_that_timed_out_still_says_who_voted_no(pages):
    """A rank that voted no and timed the round out (a tp_agree with a wrong npes waits 1 s) left a peer
    arriving later a timeout that blamed only the absent rank."""
    page = pages(3)
    early, late = PageVoter(page, 1, "group=g"), PageVoter(twin(page), 0, "group=g")
    gave_up = early.agree(False, time.monotonic() + 0.05)
    assert gave_up == cp.Verdict(False, "agreement round 1 of group=g timed out waiting for rank(s) [0, 2]; "
                                        "rank(s) [1] voted no")
    assert late.agree(True, time.monotonic() + 600) == cp.Verdict(
        False, "agreement round 1 of group=g timed out waiting for rank(s) [2] (rank 1's deadline passed first); "
               "rank(s) [1] voted no")


def test_the_first_proposal_settles_a_round_for_everyone(pages):
    page = pages(2)
    a, b = PageVoter(page, 0), PageVoter(twin(page), 1)
    page.word(cp.verdict_offset(1)).value = cp.encode_verdict(1, Outcome.TIMED_OUT, 0)  # rank 0 gave up first
    t = threading.Thread(target=lambda: b.agree(True, time.monotonic() + 600))
    t.start()
    late = a.agree(True, time.monotonic() + 600)
    t.join(60)
    assert late.ok is False and "round 1 of this group timed out waiting for rank(s) []" in late.reason, \
        "every slot reached the round, yet the AND loses to the verdict already in its entry"
    assert cp.decode_verdict(page.word(cp.verdict_offset(1)).value)[1] == Outcome.TIMED_OUT


def test_every_rank_of_a_busy_group_answers_the_same_and_no_round_is_lost(pages):
    """Eight threads, 2,000 rounds, rank 3 votes no every seventh round: each answer is the AND."""
    page = pages(8)
    voters = [PageVoter(page if r == 0 else twin(page), r, spin_s=0 if r % 2 else 1e-4) for r in range(8)]
    answers = {r: [] for r in range(8)}

    def run(r):
        for k in range(1, 2001):
            answers[r].append(voters[r].agree(not (r == 3 and k % 7 == 0), time.monotonic() + 60).ok)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [len(a) for a in answers.values()] == [2000] * 8
    assert all(a == [k % 7 != 0 for k in range(1, 2001)] for a in answers.values())


def test_threads_of_one_rank_take_turns_so_a_no_is_never_written_over(pages):
    """Three threads of rank 1 vote no, yes, yes while rank 0 waits: a third round entered while the
    first was open wrote over its vote bit (a slot holds two rounds), and the no came back True on
    every rank. Now a rank's rounds run one at a time, in the order its threads came."""
    page = pages(2)
    mine, theirs = PageVoter(page, 1, spin_s=0), PageVoter(twin(page), 0, spin_s=0)
    answers: dict[str, bool] = {}

    def vote(name, ok):
        answers[name] = mine.agree(ok, time.monotonic() + 30).ok

    threads = []
    for name, ok in (("no", False), ("yes", True), ("again", True)):
        threads.append(threading.Thread(target=vote, args=(name, ok)))
        threads[-1].start()
        time.sleep(0.2)  # each thread inside its call before the next comes
    rank0 = [theirs.agree(True, time.monotonic() + 30).ok for _ in range(3)]
    for t in threads:
        t.join(60)
    assert rank0 == [False, True, True] and answers == {"no": False, "yes": True, "again": True}, (rank0, answers)
    waiting = threading.Thread(target=vote, args=("held", True))
    waiting.start()  # round 4, open: rank 0 has not voted
    time.sleep(0.2)
    late = mine.agree(True, time.monotonic() + 0.2)
    assert not late.ok and "another thread of rank 1 held its round" in late.reason, late.reason
    assert theirs.agree(True, time.monotonic() + 30).ok and mine.rounds == 4, "the late thread voted nothing"
    waiting.join(60)


def test_a_thread_whose_turn_comes_after_its_buffer_closed_votes_nothing(pages):
    """Rank 1's thread A is in round 1, B waits for its turn, and the buffer closes meanwhile: once
    every rank released, the slot may hold the next set's page, and B voted its round there."""
    page = pages(2)
    mine, theirs = PageVoter(page, 1, spin_s=0), PageVoter(twin(page), 0, spin_s=0)
    answers: dict[str, object] = {}

    def vote(name):
        answers[name] = mine.agree(True, time.monotonic() + 30)

    first = threading.Thread(target=vote, args=("A",))
    first.start()
    time.sleep(0.2)  # A is in round 1: rank 0 has not voted
    waiting = threading.Thread(target=vote, args=("B",))
    waiting.start()
    time.sleep(0.2)  # B waits for its turn
    mine.close()
    assert theirs.agree(True, time.monotonic() + 30).ok  # round 1 ends as it would: A's
    first.join(30)
    waiting.join(30)
    assert answers["A"].ok and not answers["B"].ok and "was closed while this call waited" in answers["B"].reason
    assert mine.rounds == 1, "B voted in no round"
    assert not theirs.agree(True, time.monotonic() + 0.3).ok, "round 2 has no vote of rank 1"


def test_a_signal_handler_that_raises_ends_a_wait(pages):
    page = pages(2)
    voter = PageVoter(page, 0, spin_s=0)
    previous = signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        with pytest.raises(KeyboardInterrupt):
            voter.agree(True, time.monotonic() + 600)
    finally:
        signal.signal(signal.SIGALRM, previous)
    assert voter.rounds == 1 and page.word(cp.slot_offset(0)).value == 1, "the vote stands, as a late rank's"


def test_a_rank_spins_long_only_where_every_rank_can_have_two_cores(monkeypatch):
    monkeypatch.setattr(cp.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert cp.spin_budget(8) == cp.SPIN_OWN_CORE_S > cp.spin_budget(9) == cp.SPIN_SHARED_S


def test_a_failed_commit_on_the_page_says_whether_a_rank_voted_no_or_the_round_timed_out(pages):
    from peerd_client.pagelink import GroupLink

    page = pages(2)
    link = GroupLink(page.instance, 0, 2, "group=g name=n rank 0", agreement_timeout=60, set_id=1)
    link.page = page
    peer = PageVoter(twin(page), 1, label="group=g")
    voted = threading.Thread(target=lambda: peer.agree(False, time.monotonic() + 600))  # garbage from a member
    voted.start()
    said_no = link.commit(600)
    voted.join(60)
    assert said_no["ok"] is False and said_no["aborted"] is False
    assert "rank(s) [1] voted no" in said_no["reason"] and "timed out" not in said_no["reason"]

    alone = pages(2)
    link.page = alone
    waited = link.commit(0.05)  # rank 1 never votes
    assert waited["ok"] is False and waited["aborted"] is False
    assert "failed (waited at most 0.05s)" in waited["reason"]
    assert "timed out waiting for rank(s) [1]" in waited["reason"]


def test_a_member_rewriting_npes_after_the_check_changes_no_count_of_ranks(pages):
    """A member's garbage in the header's npes word, written after a peer checked the page, must not
    make that peer walk slots past the page (it crashed the peer with SIGSEGV)."""
    page = pages(2)
    member = twin(page)  # checked against the group's npes when found, as a joining rank does
    page.word(cp.OFF_NPES).value = 1 << 40  # the other member's garbage
    assert member.npes == 2 and member.unmapped() == [0, 1]
    voter = PageVoter(member, 1, label="group=g")
    assert voter.agree(True, time.monotonic() + 0.05) == cp.Verdict(
        False, "agreement round 1 of group=g timed out waiting for rank(s) [0]")
    fresh = Area.attach(os.dup(page.fd))
    try:
        with pytest.raises(PageError, match="npes=1099511627776, this group has npes=2"):
            fresh.page(0, 2, instance=page.instance)  # a rank that finds it only now refuses it
    finally:
        fresh.close()
