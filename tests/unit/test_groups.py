"""The group state machine, driven with fake memory and a hand-moved clock."""

from __future__ import annotations

import pytest

from peerd import quotas
from peerd.backends import Allocation
from peerd.buffersets import State
from peerd.pages import LEAVE_GRACE_S
from peerd.credentials import Credentials
from peerd.quotas import MAX_RUN_AHEAD, Limits
from peerd.registry import Registry
from peerd.protocol import ErrorCode, ProtocolError


class FakeMemory:
    def __init__(self):
        self.live: dict[bytes, Allocation] = {}
        self.serial = 0
        self.fail_next = None
        self.mapped_by: dict[bytes, list[int]] = {}  # handle -> the live pids it was freed under

    def allocate(self, nbytes, device, flags, uid):
        if self.fail_next:
            err, self.fail_next = self.fail_next, None
            raise err
        self.serial += 1
        a = Allocation("fake", b"h%d" % self.serial, nbytes, device)
        self.live[a.handle] = a
        return a

    def free(self, allocation, mapped_by):
        assert allocation.handle in self.live, "double free"
        del self.live[allocation.handle]
        self.mapped_by[allocation.handle] = sorted(mapped_by)


@pytest.fixture
def mem():
    return FakeMemory()


@pytest.fixture
def reg(mem):
    return Registry(mem.allocate, mem.free, rendezvous_timeout=10, agreement_timeout=10)


def who(pid: int, uid: int | None = None) -> Credentials:
    """A caller as the kernel would report it (uid None: the unit tests' one namespace)."""
    return Credentials(uid, uid, pid)


def join(reg, rank, npes=2, now=0.0, pid=None, **over):
    body = {"group": "g", "name": "n", "rank": rank, "npes": npes, "nbytes": 64, "device": "d",
            "flags": 0, "timeout": None, **over}
    return reg.join(("c", rank), who(pid if pid is not None else 100 + rank), body, now)


def commit(reg, rank, ok=True, now=0.0, pid=None, reason="", page=False, name="n"):
    body = {"group": "g", "name": name, "rank": rank, "ok": ok, "reason": reason, "timeout": None, "page": page}
    return reg.commit(("v", rank), who(pid if pid is not None else 100 + rank), body, now)


def release(reg, rank, pid=None):
    return reg.release(("r", rank), who(pid if pid is not None else 100 + rank), {"group": "g", "name": "n", "rank": rank}, 0.0)


def agree(reg, rank, ok=True, npes=2, now=0.0, timeout=None, group="a"):
    body = {"group": group, "rank": rank, "npes": npes, "ok": ok, "timeout": timeout}
    return reg.agree(("a", rank), who(100 + rank), body, now)


def errors(out):
    return {send.caller: send.error for send in out if send.error is not None}


def bodies(out):
    return {send.caller: send.body for send in out if send.body is not None}


def test_a_rank_a_retired_set_still_holds_is_refused_to_the_keys_new_rendezvous(reg):
    """Rank 1 released and joined the key again, so the old set retired while rank 0 still held it; rank 0
    joining too without closing it was let in, and its commit, named by key, was taken for the retired
    set's (True at once) while rank 1 waited out its timeout. Refused as the current set's holder is."""
    old = live_set(reg)
    release(reg, 1)
    assert join(reg, 1) == [] and reg.sets[(None, "g", "n")] is not old, "the old set retired"
    refused = errors(join(reg, 0))[("c", 0)]
    assert refused.code is ErrorCode.RANK_TAKEN, refused
    assert "rank 0 of group=g name=n" in refused.message, refused
    assert "still held by this same process (pid 100)" in refused.message, refused
    named = {"group": "g", "name": "n", "rank": 0, "ok": True, "reason": "", "timeout": None, "page": False}
    elsewhere = errors(reg.commit(("v", 0), who(100), {**named, "set": old.id + 1000}, 0.0))[("v", 0)]
    assert elsewhere.code is ErrorCode.NOT_FOUND, "a commit naming a set answers for that set alone"


def live_set(reg, npes=2):
    for r in range(npes):
        join(reg, r, npes)
    for r in range(npes):
        commit(reg, r)
    return reg.sets[(None, "g", "n")]


def test_rendezvous_answers_every_rank_at_once_with_every_handle(reg, mem):
    assert join(reg, 1, npes=3) == []
    assert join(reg, 0, npes=3) == []
    out = join(reg, 2, npes=3)
    replies = bodies(out)
    assert set(replies) == {("c", 0), ("c", 1), ("c", 2)}
    for body in replies.values():
        assert body["handles"] == [mem.live[h].handle for h in body["handles"]]
        assert len(body["handles"]) == 3 and body["sizes"] == [64] * 3 and body["backend"] == "fake"
    assert reg.sets[(None, "g", "n")].state is State.OPENING


def test_commit_all_true_goes_live_and_any_false_fails_every_rank(reg, mem):
    bset = live_set(reg)
    assert bset.state is State.LIVE
    reg2 = Registry(mem.allocate, mem.free)
    join(reg2, 0), join(reg2, 1)
    assert commit(reg2, 0, ok=True) == []
    out = commit(reg2, 1, ok=False, reason="cudaIpcOpenMemHandle: invalid handle")
    verdicts = bodies(out)
    assert verdicts[("v", 0)]["ok"] is False and verdicts[("v", 1)]["ok"] is False
    assert "rank 1: cudaIpcOpenMemHandle: invalid handle" in verdicts[("v", 0)]["reason"]
    assert reg2.sets[(None, "g", "n")].state is State.FAILED


@pytest.mark.parametrize("field, value", [("npes", 4), ("nbytes", 128), ("flags", 1)])
def test_mismatch_is_reported_to_every_rank_and_frees_memory(reg, mem, field, value):
    join(reg, 0, npes=3)
    out = join(reg, 1, **{"npes": 3, field: value})
    failed = errors(out)
    assert set(failed) == {("c", 0), ("c", 1)}
    for err in failed.values():
        assert err.code is ErrorCode.MISMATCH
        assert f"{field}={value} but rank 0 (pid 100) joined with {field}=" in err.message
    assert mem.live == {}
    late = errors(join(reg, 2, npes=3))
    assert late[("c", 2)].code is ErrorCode.MISMATCH, "a late rank hears the same verdict, not a hang"
    assert reg.sets == {}, "once every rank heard the verdict it is forgotten"


def test_a_rank_that_comes_after_its_set_timed_out_hears_it_as_a_late_rank(reg):
    """The late rank was told, at once, the verdict as its peers heard it: that it had itself "never
    joined", with its own timeout= never run, and nothing on what to do."""
    join(reg, 0, now=0.0, timeout=2.0)
    assert errors(reg.expire(2.0))[("c", 0)].code is ErrorCode.TIMEOUT
    late = errors(join(reg, 1, now=4.0, timeout=20.0))[("c", 1)]
    assert late.code is ErrorCode.TIMEOUT, late
    assert late.message.startswith("group=g name=n had already failed when rank 1 (pid 101) came: rendezvous of "
                                   "group=g name=n timed out after 2.0s: rank(s) [1] of 2 never joined"), late
    assert late.message.endswith("a rank this late needs a longer timeout= on every rank (default: the daemon's "
                                 "--rendezvous-timeout)"), late


def test_a_join_outside_the_set_does_not_count_as_one_of_its_ranks_hearing_the_verdict(reg):
    """A join with npes=3 as rank 2 fails a 2-rank set (MISMATCH); rank 2 is none of its ranks, so rank 1,
    still to come, is still owed the verdict: it hears it instead of starting a rendezvous of its own."""
    join(reg, 0)
    assert errors(join(reg, 2, npes=3, pid=300))[("c", 2)].code is ErrorCode.MISMATCH
    late = errors(join(reg, 1))[("c", 1)]
    assert late.code is ErrorCode.MISMATCH, "the kept verdict, not a new rendezvous"


def test_rank_out_of_range_and_taken(reg):
    invalid = errors(join(reg, 2))[("c", 2)]
    assert invalid.code is ErrorCode.RANK_INVALID
    assert invalid.message == "rank 2 of group=g is out of range for npes=2 (its ranks are 0 to 1)", invalid.message
    agreeing = errors(agree(reg, 3))[("a", 3)]
    assert agreeing.code is ErrorCode.RANK_INVALID and "rank 3 of group=a is out of range" in agreeing.message
    join(reg, 0)
    taken = errors(join(reg, 0, pid=999))[("c", 0)]
    assert taken.code is ErrorCode.RANK_TAKEN and "already joined by pid 100" in taken.message


def test_a_join_refused_for_its_rank_or_size_fails_the_rendezvous_its_peers_wait_in(mem):
    """A rank past npes, or over --max-buffer-bytes, is refused, and rank 0, already waiting, hears why at once;
    a rank still to come hears the kept verdict (both waited out the rendezvous for a rank that never came)."""
    reg = Registry(mem.allocate, mem.free, limits=Limits(max_buffer_bytes=100))
    join(reg, 0)
    out = join(reg, 2)
    assert errors(out)[("c", 2)].code is ErrorCode.RANK_INVALID
    waiting = errors(out)[("c", 0)]
    assert waiting.code is ErrorCode.GROUP_FAILED and "pid 102 asked to join group=g name=n as rank 2 of npes=2" \
        in waiting.message, waiting
    assert errors(join(reg, 1))[("c", 1)].code is ErrorCode.GROUP_FAILED, "the kept verdict"
    big = errors(join(reg, 1, nbytes=101, name="big"))
    assert big[("c", 1)].code is ErrorCode.LIMIT_EXCEEDED and "limit of 100 bytes" in big[("c", 1)].message
    told = errors(join(reg, 0, name="big"))[("c", 0)]
    assert told.code is ErrorCode.GROUP_FAILED and "rank 1 (pid 101) of group=g name=big cannot take part: " \
        "nbytes=101" in told.message, told
    assert mem.live == {}


def test_a_rendezvous_timeout_names_a_missing_rank_waiting_in_another_set_of_the_group(reg):
    """Rank 1's process waits in set b of the group while set a waits for its rank 1: two threads of each
    process built the sets in opposite orders, and one process's calls take turns. Said "never joined"."""
    join(reg, 0, name="a")
    join(reg, 1, name="b")
    failed = errors(reg.expire(10.0))
    assert "rank(s) [1] of 2 never joined" in failed[("c", 0)].message
    assert "rank 1 (pid 101) waits in name=b, another set of the group" in failed[("c", 0)].message, failed
    assert "build the sets of a group in the same order" in failed[("c", 0)].message


def test_ranks_all_refused_for_their_size_may_try_again_together(mem):
    """Both ranks refused over --max-buffer-bytes (their size comes from one config) each left a verdict of
    their own: on the next try with a size that fits, rank 0 heard rank 1's, and rank 1 waited alone."""
    reg = Registry(mem.allocate, mem.free, limits=Limits(max_buffer_bytes=100))
    for rank in range(2):
        assert errors(join(reg, rank, nbytes=101))[("c", rank)].code is ErrorCode.LIMIT_EXCEEDED
    assert join(reg, 0) == [], "a new rendezvous, not a verdict"
    opened = bodies(join(reg, 1))
    assert set(opened) == {("c", 0), ("c", 1)} and all(len(b["handles"]) == 2 for b in opened.values()), opened


def test_rendezvous_timeout_fails_every_waiting_rank_naming_the_missing(reg, mem):
    join(reg, 0, npes=4, now=0.0)
    join(reg, 2, npes=4, now=1.0)
    assert reg.expire(9.9) == []
    assert reg.next_deadline() == 10.0
    failed = errors(reg.expire(10.0))
    assert set(failed) == {("c", 0), ("c", 2)}
    msg = failed[("c", 0)].message
    assert failed[("c", 0)].code is ErrorCode.TIMEOUT
    assert "rank(s) [1, 3] of 4 never joined" in msg and "rank 0 (pid 100), rank 2 (pid 102)" in msg
    assert mem.live == {}


def test_per_call_timeout_overrides_the_default(reg):
    join(reg, 0, timeout=0.5)
    assert errors(reg.expire(0.5))[("c", 0)].code is ErrorCode.TIMEOUT


def test_memory_is_freed_only_when_every_rank_released(reg, mem):
    live_set(reg, npes=3)
    assert len(mem.live) == 3
    assert bodies(release(reg, 0))[("r", 0)] == {"freed": False}
    assert bodies(release(reg, 2))[("r", 2)] == {"freed": False}
    assert len(mem.live) == 3, "a released rank must not free memory its peers still map"
    assert bodies(release(reg, 1))[("r", 1)] == {"freed": True}
    assert mem.live == {} and reg.sets == {}


def test_release_twice_and_release_by_another_process(reg):
    live_set(reg)
    stranger = errors(release(reg, 0, pid=555))[("r", 0)]
    assert stranger.code is ErrorCode.NOT_MEMBER and "belongs to pid 100" in stranger.message
    release(reg, 0)
    again = errors(release(reg, 0))[("r", 0)]
    assert again.code is ErrorCode.NOT_FOUND


def test_withdrawing_during_rendezvous_fails_the_others(reg, mem):
    join(reg, 0, npes=3), join(reg, 1, npes=3)
    out = release(reg, 1)
    assert bodies(out)[("r", 1)] == {"freed": True}
    failed = errors(out)
    assert failed[("c", 0)].code is ErrorCode.GROUP_FAILED and "withdrew" in failed[("c", 0)].message
    assert mem.live == {}


def test_allocation_failure_fails_every_rank(reg, mem):
    join(reg, 0)
    mem.fail_next = ProtocolError(ErrorCode.ALLOCATION_FAILED, "out of memory on GPU-1")
    failed = errors(join(reg, 1))
    assert {e.code for e in failed.values()} == {ErrorCode.ALLOCATION_FAILED}
    assert "rank 1 (pid 101): out of memory on GPU-1" in failed[("c", 0)].message
    assert mem.live == {}


class SlowMemory(FakeMemory):
    """Memory a backend still reserves off the loop: ``ready`` is False until the test says otherwise."""

    def __init__(self):
        super().__init__()
        self.reserved: set[bytes] = set()
        self.failed: dict[bytes, ProtocolError] = {}

    def ready(self, allocation):
        if allocation.handle in self.failed:
            raise self.failed[allocation.handle]
        return allocation.handle in self.reserved


@pytest.fixture
def slow():
    memory = SlowMemory()
    return memory, Registry(memory.allocate, memory.free, rendezvous_timeout=10, agreement_timeout=10,
                            ready=memory.ready)


def test_a_set_opens_only_once_every_ranks_memory_is_ready(slow):
    mem, reg = slow
    join(reg, 0)
    assert join(reg, 1) == [] and reg.memory_ready(0.1, [b"h1", b"h2"]) == [], "every rank in, the memory not yet reserved"
    mem.reserved.add(b"h1")
    assert reg.memory_ready(0.2, [b"h1"]) == [], "rank 1's memory is still being reserved"
    mem.reserved.add(b"h2")
    opened = bodies(reg.memory_ready(0.3, [b"h2"]))
    assert set(opened) == {("c", 0), ("c", 1)} and opened[("c", 0)]["handles"] == [b"h1", b"h2"]
    assert reg.memory_ready(0.4, [b"h1", b"h2"]) == [], "opened once"



def test_a_chunk_that_turns_ready_asks_only_the_sets_waiting_on_it(slow):
    """The backend names the chunks whose memory may be ready: a set waiting on another chunk is not
    asked, however many sets wait, so a user with many sets waiting costs no one else's wake-up."""
    mem, reg = slow
    join(reg, 0)
    join(reg, 1)  # set "n": h1, h2
    join(reg, 0, name="m")
    join(reg, 1, name="m")  # set "m": h3, h4
    mem.reserved |= {b"h1", b"h2", b"h3", b"h4"}
    asked = []
    ready = reg._sets._ready
    reg._sets._ready = lambda allocation: asked.append(allocation.handle) or ready(allocation)
    assert set(bodies(reg.memory_ready(0.1, [b"h3"]))) == {("c", 0), ("c", 1)}
    assert sorted(asked) == [b"h3", b"h4"], "only the set waiting on h3 was asked"
    assert set(bodies(reg.memory_ready(0.2, [b"h1", b"h2", b"h9"]))) == {("c", 0), ("c", 1)}
    assert reg._sets._unready == {}, "no set waits any more"

def test_a_second_claim_on_a_rank_of_a_set_waiting_for_its_memory_is_refused_alone(slow):
    """Every rank joined and the memory is still being reserved: a straggler claiming a taken rank, even
    with other sizes, cannot be a member, so it alone is refused (RANK_TAKEN) and the set still opens."""
    mem, reg = slow
    join(reg, 0)
    join(reg, 1)
    straggler = errors(join(reg, 0, pid=999, nbytes=128))[("c", 0)]
    assert straggler.code is ErrorCode.RANK_TAKEN and "already joined by pid 100" in straggler.message
    mem.reserved |= {b"h1", b"h2"}
    assert set(bodies(reg.memory_ready(0.1, [b"h1", b"h2"]))) == {("c", 0), ("c", 1)}


def test_memory_that_could_not_be_reserved_fails_the_set_for_every_rank_and_is_freed(slow):
    mem, reg = slow
    join(reg, 0)
    join(reg, 1)
    mem.failed[b"h2"] = ProtocolError(ErrorCode.ALLOCATION_FAILED, "cannot reserve 64 bytes: No space left")
    failed = errors(reg.memory_ready(0.1, [b"h2"]))
    assert set(failed) == {("c", 0), ("c", 1)} and {e.code for e in failed.values()} == {ErrorCode.ALLOCATION_FAILED}
    assert "cannot reserve 64 bytes: No space left" in failed[("c", 0)].message and mem.live == {}
    assert reg.memory_ready(0.2, [b"h1", b"h2"]) == [], "a failed set waits for nothing"


def test_a_set_waiting_for_its_memory_fails_on_a_death_or_its_timeout_and_is_forgotten(slow):
    mem, reg = slow
    join(reg, 0)
    join(reg, 1)
    died = errors(reg.process_died(101, 1.0))
    assert died[("c", 0)].code is ErrorCode.RANK_DIED and "died before its set's memory was ready" in \
        died[("c", 0)].message, died
    mem.reserved.update({b"h1", b"h2"})
    assert reg.memory_ready(1.1, [b"h1", b"h2"]) == [] and mem.live == {}, "the dead set does not open"
    join(reg, 0, name="other", now=2.0)
    join(reg, 1, name="other", now=2.0)
    timed_out = errors(reg.expire(12.0))
    assert {e.code for e in timed_out.values()} == {ErrorCode.TIMEOUT}
    assert "every rank joined, but the 64 B buffers of its ranks were still being reserved" in \
        timed_out[("c", 0)].message, timed_out


def test_a_new_set_can_take_a_key_while_an_old_one_is_still_held(reg, mem):
    live_set(reg)
    release(reg, 0)  # rank 0 starts over while rank 1 still holds the old set
    join(reg, 0, pid=200)
    assert len(reg.retired) == 1 and len(mem.live) == 3
    release(reg, 1)  # rank 1 lets the old set go: its memory goes with it
    assert reg.retired == {} and len(mem.live) == 1


def test_joining_a_rank_still_held_is_refused_naming_the_holder(reg):
    """A process's second buffer set of one group under the same name= was told its rank "is still held by
    pid N", its own pid: a port of the seeds, which allow any number of buffers, could not tell why."""
    live_set(reg)
    err = errors(join(reg, 0))[("c", 0)]
    assert err.code is ErrorCode.RANK_TAKEN and "still held by this same process (pid 100)" in err.message
    assert "give each buffer set of one group its own name=" in err.message, err.message
    other = errors(join(reg, 0, pid=300))[("c", 0)]
    assert other.code is ErrorCode.RANK_TAKEN and "still held by pid 100;" in other.message, other.message


def test_a_rendezvous_that_times_out_names_a_rank_two_processes_asked_for(reg):
    """The survivor was told only that rank 1 never joined, which sent its operator after a missing
    process: the daemon had seen two processes ask for rank 0, the usual sign of a rank mapping bug."""
    join(reg, 0, now=0.0)
    assert errors(join(reg, 0, pid=999, now=1.0))[("c", 0)].code is ErrorCode.RANK_TAKEN
    failed = errors(reg.expire(10.0))[("c", 0)]
    assert failed.code is ErrorCode.TIMEOUT and "rank(s) [1] of 2 never joined" in failed.message, failed
    assert "a rank was asked for again (rank 0 by pid 999): do two processes take one rank?" in failed.message


def test_death_during_rendezvous_fails_the_others_naming_rank_and_pid(reg, mem):
    join(reg, 0, npes=3), join(reg, 1, npes=3)
    failed = errors(reg.process_died(101, 1.0))
    assert failed[("c", 0)].code is ErrorCode.RANK_DIED
    assert "rank 1 (pid 101)" in failed[("c", 0)].message
    assert mem.live == {}


def test_death_during_the_commit_vote_makes_it_false(reg, mem):
    join(reg, 0), join(reg, 1)
    commit(reg, 0)
    verdict = bodies(reg.process_died(101, 1.0))[("v", 0)]
    assert verdict["ok"] is False and "rank 1 (pid 101)" in verdict["reason"] and "died" in verdict["reason"]
    assert len(mem.live) == 2, "rank 0 may have mapped the memory: it stays until rank 0 releases"
    release(reg, 0)
    assert mem.live == {}


def test_death_after_live_counts_as_release(reg, mem):
    live_set(reg)
    assert reg.process_died(100, 5.0) == []
    assert len(mem.live) == 2
    reg.process_died(101, 6.0)
    assert mem.live == {} and reg.sets == {}


def test_commit_timeout_names_the_ranks_that_never_voted(reg):
    join(reg, 0), join(reg, 1)
    commit(reg, 0, now=1.0)
    verdict = bodies(reg.expire(11.0))[("v", 0)]
    assert verdict["ok"] is False and "rank 1 (pid 101)" in verdict["reason"] and "timed out" in verdict["reason"]


def test_agreement_rounds_pair_the_kth_call_of_each_rank(reg):
    assert agree(reg, 0, True) == []
    assert agree(reg, 0, False) == []  # rank 0 is already in round 2
    first = bodies(agree(reg, 1, True))
    assert first == {("a", 0): {"ok": True, "reason": ""}, ("a", 1): {"ok": True, "reason": ""}}
    second = bodies(agree(reg, 1, True))
    assert second[("a", 1)]["ok"] is False
    assert reg.agreements[(None, "a")].rounds == {} and reg.agreements[(None, "a")].calls == {}, "passed rounds are forgotten"


def test_a_new_set_names_the_sets_of_its_group_a_rank_no_longer_holds(reg):
    """Told to every rank in the same reply: a rank still holding such a set votes on the new one from then
    on, as its peer that left it does (peerd_client.pagelink.link_for)."""
    old = live_set(reg)
    release(reg, 1)
    join(reg, 0, name="again")
    replies = bodies(join(reg, 1, name="again"))
    assert [body.get("supersedes") for body in replies.values()] == [[old.id]] * 2, replies
    release(reg, 0)
    for r in range(2):
        commit(reg, r, name="again")
    third = [bodies(join(reg, r, name="third")) for r in range(2)][1]
    assert all("supersedes" not in body for body in third.values()), "a set every rank let go of is no one's"


def test_a_vote_with_another_npes_than_the_groups_sets_is_refused_and_fixes_nothing(reg):
    """A stray process of the uid voting first as rank 2 of 3 fixed the agreement's npes at 3: the group's
    real ranks, of a 2-rank set, got MISMATCH for as long as any of them lived."""
    live_set(reg)
    body = {"group": "g", "rank": 2, "npes": 3, "ok": True, "timeout": None}
    stray = errors(reg.agree(("stray", 2), who(555), body, 0.0))[("stray", 2)]
    assert stray.code is ErrorCode.MISMATCH and "the group's buffer sets have npes=2" in stray.message, stray
    agree(reg, 0, group="g")
    verdict = bodies(agree(reg, 1, group="g"))
    assert verdict[("a", 0)] == verdict[("a", 1)] == {"ok": True, "reason": ""}


def test_a_holder_voting_with_another_npes_than_its_set_fails_its_peers_round_at_once(reg):
    """The holder of rank 1 of the group's 2-rank set votes first, as one of 3: refused, and rank 0's round
    of the group's agreement (of 2, its set's npes) is False as soon as rank 0 votes."""
    live_set(reg)
    assert errors(agree(reg, 1, npes=3, group="g"))[("a", 1)].code is ErrorCode.MISMATCH
    verdict = bodies(agree(reg, 0, group="g"))[("a", 0)]
    assert verdict["ok"] is False and "rank 1: called tp_agree with npes=3" in verdict["reason"], verdict


def test_a_wrong_npes_vote_is_no_vote_where_the_agreement_is_older_than_the_groups_sets(reg):
    """The group's agreement was of 3 (votes before any set), its set is of 2: the holder of rank 1 voting as one
    of 3 is refused and enters nothing; it was taken as a plain vote in the stale round."""
    agree(reg, 0, npes=3, group="g")
    live_set(reg)
    refused = errors(reg.agree(("h", 1), who(101), {"group": "g", "rank": 1, "npes": 3, "ok": True, "timeout": None},
                               0.0))[("h", 1)]
    assert refused.code is ErrorCode.MISMATCH and "called tp_agree with npes=3, but the group has npes=2" in \
        refused.message, refused
    assert reg.agreements[(None, "g")].rounds[1].votes == {0: True}, "rank 1 entered nothing"


def test_an_agreement_older_than_the_groups_sets_gives_way_to_their_npes(reg):
    """The key agreed as a group of 3 (its voters live on), then its ranks built a set of 2: every call of the
    set's ranks was refused, "the group has npes=3", for as long as an old voter lived."""
    for rank in range(3):
        agree(reg, rank, npes=3, group="g")
    live_set(reg)
    agree(reg, 0, group="g")
    assert bodies(agree(reg, 1, group="g"))[("a", 1)] == {"ok": True, "reason": ""}


def test_a_round_that_times_out_says_which_rank_voted_no_and_why(reg):
    agree(reg, 0, npes=3)
    agree(reg, 1, npes=4)
    reason = bodies(reg.expire(10.0))[("a", 0)]["reason"]
    assert "waiting for rank(s) [2]; rank 1: called tp_agree with npes=4, but the group has npes=3" in reason, reason


def test_a_round_ends_at_the_earliest_deadline_of_its_voters(reg):
    """A later voter's shorter timeout ends the round for every rank, as on the page: the daemon kept the
    first voter's 20 s, so the second's client gave up at its own 1 s (DaemonUnavailable, not False)."""
    agree(reg, 0, now=0.0, npes=3, timeout=20)
    agree(reg, 1, now=0.5, npes=3, timeout=1)
    assert reg.expire(1.4) == []
    out = bodies(reg.expire(1.5))
    assert {caller: body["ok"] for caller, body in out.items()} == {("a", 0): False, ("a", 1): False}
    assert "timed out after 1s waiting for rank(s) [2]" in out[("a", 0)]["reason"], out
    assert reg.expire(30.0) == [], "the first voter's own deadline went with the round"
    agree(reg, 0, now=31.0, npes=3, timeout=1)  # the next round keeps its own deadlines
    agree(reg, 1, now=31.0, npes=3, timeout=5)
    assert {c: b["ok"] for c, b in bodies(reg.expire(32.0)).items()} == {("a", 0): False, ("a", 1): False}


def test_agreement_timeout_is_false_with_a_reason_and_late_ranks_hear_it(reg):
    agree(reg, 0, now=0.0, npes=3)
    agree(reg, 1, now=0.0, npes=3)
    out = bodies(reg.expire(10.0))
    assert out[("a", 0)]["ok"] is False and "waiting for rank(s) [2]" in out[("a", 0)]["reason"]
    late = bodies(agree(reg, 2, npes=3, now=20.0))[("a", 2)]
    assert late["ok"] is False and "timed out" in late["reason"]
    assert reg.agreements[(None, "a")].rounds == {}


def test_a_dead_rank_makes_pending_and_later_rounds_false(reg):
    agree(reg, 0), agree(reg, 1)  # round 1 done: rank 1 is a known member now
    agree(reg, 0)
    died = bodies(reg.process_died(101, 1.0))
    assert died[("a", 0)] == {"ok": False, "reason": "rank 1 (pid 101) died"}
    later = bodies(agree(reg, 0))[("a", 0)]
    assert later == {"ok": False, "reason": "rank 1 (pid 101) died"}, "no waiting on a dead rank"
    reg.process_died(100, 2.0)
    assert reg.agreements == {}, "a group whose members all died is forgotten"


def test_a_new_process_may_take_a_dead_ranks_place(reg):
    agree(reg, 0), agree(reg, 1)
    reg.process_died(101, 1.0)
    fresh = {"group": "a", "rank": 1, "npes": 2, "ok": True, "timeout": None}
    assert reg.agree(("n", 1), who(201), fresh, 2.0) == []
    assert bodies(agree(reg, 0))[("a", 0)]["ok"] is True


def test_a_process_taking_a_dead_ranks_place_leaves_the_survivors_rounds_in_step(reg):
    """The survivors' k-th calls stay one round: a slow survivor gets False for the rounds its fast peer
    was told were False, and the newcomer's first call is the round after every one entered."""
    def vote(rank, pid=None):
        body = {"group": "a", "rank": rank, "npes": 3, "ok": True, "timeout": None}
        return bodies(reg.agree(("a", rank), who(pid or 100 + rank), body, 0.0))

    vote(0), vote(1), vote(2)  # a round all three agreed on
    reg.process_died(102, 1.0)
    assert vote(0)[("a", 0)]["ok"] is False and vote(0)[("a", 0)]["ok"] is False  # rank 0 is two rounds on
    assert vote(2, pid=202) == {}, "the newcomer waits in the round after those"
    assert vote(1)[("a", 1)]["ok"] is False and vote(1)[("a", 1)]["ok"] is False, "rank 1's rounds, as rank 0's"
    assert vote(0) == {}
    verdict = vote(1)
    assert verdict[("a", 0)]["ok"] and verdict[("a", 1)]["ok"] and verdict[("a", 2)]["ok"], verdict


def test_a_rank_that_ran_ahead_and_died_leaves_its_peers_and_its_successor_a_real_next_round(reg):
    for _ in range(MAX_RUN_AHEAD + 12):
        agree(reg, 1)  # rounds past the window: False at once, rank 0 having entered none
    for _ in range(MAX_RUN_AHEAD + 4):
        agree(reg, 0)
    reg.process_died(101, 1.0)
    fresh = {"group": "a", "rank": 1, "npes": 2, "ok": True, "timeout": None}
    assert reg.agree(("n", 1), who(201), fresh, 2.0) == []
    verdict = bodies(agree(reg, 0))
    assert verdict[("a", 0)]["ok"] is True and verdict[("n", 1)]["ok"] is True, verdict


def test_a_buffer_set_member_that_dies_fails_its_groups_agreement(reg):
    live_set(reg)  # group "g": ranks 0 and 1 hold buffers, neither has agreed yet
    agree(reg, 0, group="g")
    waiting = bodies(reg.process_died(101, 1.0))
    assert waiting[("a", 0)]["ok"] is False and "rank 1 (pid 101) died" in waiting[("a", 0)]["reason"]
    reg.agreements.clear()
    late = bodies(agree(reg, 0, group="g"))
    assert late[("a", 0)]["ok"] is False, "a death before the first vote is known too"


def test_agreement_npes_mismatch_and_impostor(reg):
    """A rank that gets npes wrong is refused, and its no ends the round its peer waits in at once (it
    waited out the timeout, blaming rank 1 as absent); the next round finds both in step."""
    agree(reg, 0, npes=2)
    out = agree(reg, 1, npes=3)
    assert errors(out)[("a", 1)].code is ErrorCode.MISMATCH
    assert bodies(out)[("a", 0)] == {"ok": False, "reason": "rank 1: called tp_agree with npes=3, but the group "
                                                            "has npes=2"}
    agree(reg, 0, npes=2)
    assert bodies(agree(reg, 1, npes=2))[("a", 1)] == {"ok": True, "reason": ""}
    impostor = reg.agree(("x", 0), who(999), {"group": "a", "rank": 0, "npes": 2, "ok": True, "timeout": None}, 0.0)
    assert errors(impostor)[("x", 0)].code is ErrorCode.NOT_MEMBER


def test_shutdown_fails_every_waiter_and_frees_everything(reg, mem):
    live_set(reg)
    body = {"group": "w", "name": "n", "rank": 0, "npes": 2, "nbytes": 8, "device": "d", "flags": 0, "timeout": None}
    reg.join(("w", 0), who(300), body, 0.0)
    agree(reg, 0, group="pending")
    failed = errors(reg.shutdown())
    assert set(failed) == {("w", 0), ("a", 0)}
    assert {e.code for e in failed.values()} == {ErrorCode.SHUTTING_DOWN}
    assert mem.live == {} and reg.sets == {} and reg.agreements == {}


def test_limits_refuse_before_allocating(mem):
    limits = Limits(max_buffer_bytes=100, max_bytes_per_uid=150, max_bytes_per_device=None, max_groups=2, max_ranks=4)
    reg = Registry(mem.allocate, mem.free, limits=limits)
    assert "limit of 100 bytes (100 B) per buffer" in errors(join(reg, 0, nbytes=101))[("c", 0)].message
    assert "limit of 4 ranks per group" in errors(join(reg, 0, npes=5))[("c", 0)].message
    body = {"group": "g", "name": "n", "rank": 0, "npes": 2, "nbytes": 64, "device": "d", "flags": 0, "timeout": None}
    reg.join(("u", 0), who(100, 7), body, 0.0)
    reg.join(("u", 1), who(101, 7), {**body, "rank": 1}, 0.0)
    over = errors(reg.join(("u", 2), who(102, 7), {**body, "name": "m"}, 0.0))[("u", 2)]
    assert over.code is ErrorCode.LIMIT_EXCEEDED and "uid 7 holds 128 bytes and asks for 64 more" in over.message
    assert len(mem.live) == 2
    reg.join(("v", 0), who(200, 8), {**body, "name": "x"}, 0.0)
    third = errors(reg.join(("w", 0), who(300, 9), {**body, "name": "y"}, 0.0))[("w", 0)]
    assert "already holds 2 buffer sets" in third.message


def test_one_uid_holds_at_most_its_share_of_the_sets_and_the_others_still_get_theirs(mem):
    reg = Registry(mem.allocate, mem.free, limits=Limits(max_groups=4, max_groups_per_uid=2))
    body = {"group": "g", "name": "n", "rank": 0, "npes": 1, "nbytes": 64, "device": "d", "flags": 0, "timeout": None}
    for name in ("a", "b"):
        assert bodies(reg.join(("e", name), who(100, 7), {**body, "name": name}, 0.0)), "within its share"
    over = errors(reg.join(("e", "c"), who(100, 7), {**body, "name": "c"}, 0.0))[("e", "c")]
    assert over.code is ErrorCode.LIMIT_EXCEEDED
    assert over.message == ("uid 7 already holds 2 buffer sets (--max-groups-per-uid 2); a new group=g name=c "
                            "is refused: try again once one of its sets is freed")
    assert bodies(reg.join(("o", 0), who(200, 8), body, 0.0)), "another uid still gets a set"
    withdrawn = reg.withdraw(("e", "w"), who(100, 7), {"group": "w", "name": "n", "rank": 0, "npes": 2,
                                                       "reason": "no GPU"}, 0.0)
    assert bodies(withdrawn) == {("e", "w"): {}} and (7, "w", "n") not in reg.sets, \
        "no room within its share to keep a withdrawal's verdict either"


def test_each_uid_has_its_own_key_namespace(reg):
    """A user who takes another's key gets a group of her own: she can neither block nor touch the first."""
    body = {"group": "g", "name": "n", "rank": 0, "npes": 2, "nbytes": 64, "device": "d", "flags": 0, "timeout": None}
    assert reg.join(("a", 0), who(100, 1000), body, 0.0) == []
    squatter = [reg.join(("b", r), who(200 + r, 1001), {**body, "rank": r}, 0.0) for r in (0, 1)]
    assert set(bodies(squatter[1])) == {("b", 0), ("b", 1)}, "her own set opens"
    assert reg.join(("r", 1), who(300, 0), {**body, "rank": 1}, 0.0) == [], "root joins root's own namespace"
    first = reg.sets[(1000, "g", "n")]
    assert first.state is State.JOINING and sorted(first.slots) == [0], "user 1000's set is untouched"
    slot = {"group": "g", "name": "n", "rank": 0}
    refused = errors(reg.release(("x", 0), who(100, 1001), slot, 0.0))[("x", 0)]
    assert refused.code is ErrorCode.NOT_MEMBER and first.slots[0].held
    assert bodies(reg.join(("a", 1), who(101, 1000), {**body, "rank": 1}, 0.0)), "user 1000's job completes"
    vote = {"group": "v", "rank": 0, "npes": 2, "ok": True, "timeout": None}
    assert reg.agree(("p", 0), who(100, 1000), vote, 0.0) == []
    assert reg.agree(("q", 1), who(201, 1001), {**vote, "rank": 1, "ok": False}, 0.0) == []
    assert bodies(reg.agree(("p", 1), who(101, 1000), {**vote, "rank": 1}, 0.0))[("p", 0)]["ok"] is True


def test_listing_shows_admins_every_uid_and_others_their_own(mem):
    reg = Registry(mem.allocate, mem.free, admins=frozenset({0, 42}))
    body = {"group": "g", "name": "n", "rank": 0, "npes": 2, "nbytes": 64, "device": "d", "flags": 0, "timeout": None}
    for uid, group in ((1001, "b"), (1000, "b"), (1000, "a")):
        reg.join((uid, group), who(uid, uid), {**body, "group": group}, 0.0)
    assert [(e["group"], e["uid"]) for e in reg.listing(0.0, 0)[0]] == [("a", 1000), ("b", 1000), ("b", 1001)]
    assert [(e["group"], e["uid"]) for e in reg.listing(0.0, 42)[0]] == [("a", 1000), ("b", 1000), ("b", 1001)]
    assert [(e["group"], e["uid"]) for e in reg.listing(0.0, 1001)[0]] == [("b", 1001)]
    assert reg.listing(0.0, 7) == ([], False)
    first, more = reg.listing(0.0, 0, limit=1)
    assert [(e["group"], e["uid"]) for e in first] == [("a", 1000)] and more
    rest, more = reg.listing(0.0, 0, after=["a", "n", 1000])  # an older client's cursor: after that key's sets
    assert [(e["group"], e["uid"]) for e in rest] == [("b", 1000), ("b", 1001)] and not more
    rest, more = reg.listing(0.0, 0, after=["a", "n", 1000, first[0]["set"]])
    assert [(e["group"], e["uid"]) for e in rest] == [("b", 1000), ("b", 1001)] and not more


def test_a_page_of_ls_describes_only_the_sets_it_shows(mem, monkeypatch):
    """A user asking for `ls` in a loop costs the daemon a sort of its own sets' keys, not a description of
    every set: only the page's entries are rendered, and other users' sets are not even looked at."""
    from peerd import registry as registry_module

    reg = Registry(mem.allocate, mem.free)
    body = {"group": "g", "rank": 0, "npes": 2, "nbytes": 64, "device": "d", "flags": 0, "timeout": None}
    for uid in (1000, 2000):
        for i in range(50):
            reg.join((uid, i), who(uid, uid), {**body, "name": f"n{i:02}"}, 0.0)
    rendered = []
    entry = registry_module.listing_entry
    monkeypatch.setattr(registry_module, "listing_entry", lambda b, now: rendered.append(b) or entry(b, now))
    shown, more = reg.listing(0.0, 1000, limit=5)
    assert [e["name"] for e in shown] == ["n00", "n01", "n02", "n03", "n04"] and more
    assert len(rendered) == 5 and {b.owner_uid for b in rendered} == {1000}


def test_evict_reaches_every_namespace_unless_a_uid_narrows_it(reg, mem):
    body = {"group": "g", "name": "n", "rank": 0, "npes": 2, "nbytes": 64, "device": "d", "flags": 0, "timeout": None}
    for uid in (1000, 1001, 1002):
        reg.join((uid, 0), who(uid, uid), body, 0.0)
    _, evicted = reg.evict("g", None, uid=1001)
    assert [e["uid"] for e in evicted] == [1001] and set(reg.sets) == {(1000, "g", "n"), (1002, "g", "n")}
    _, evicted = reg.evict("g", None)
    assert sorted(e["uid"] for e in evicted) == [1000, 1002] and reg.sets == {} and mem.live == {}


def test_rounds_too_far_ahead_are_false_for_every_rank_and_kept_as_one_number(reg):
    """A rank whose peer stopped voting gets False past the window, and each call is still its round:
    the peer that comes back gets False for those very rounds, then both agree again in step."""
    for _ in range(MAX_RUN_AHEAD):
        assert agree(reg, 0) == []
    ahead = bodies(agree(reg, 0))[("a", 0)]
    assert ahead["ok"] is False and f"at most {MAX_RUN_AHEAD} rounds ahead" in ahead["reason"]
    assert bodies(agree(reg, 0))[("a", 0)]["ok"] is False, "round 10: False too, answered at once"
    agreement = reg.agreements[(None, "a")]
    assert len(agreement.rounds) == MAX_RUN_AHEAD, "nothing kept past the window"
    for k in range(1, MAX_RUN_AHEAD + 1):  # the late rank's first rounds are the ones rank 0 voted in
        assert bodies(agree(reg, 1))[("a", 0)]["ok"] is True, k
    for k in (MAX_RUN_AHEAD + 1, MAX_RUN_AHEAD + 2):  # then the rounds rank 0 was told were False
        late = bodies(agree(reg, 1))[("a", 1)]
        assert late["ok"] is False and "rounds ahead" in late["reason"], k
    assert agreement.rounds == {} and agreement.calls == {} and agreement.beyond == 0, "in step again"
    agree(reg, 0)
    assert bodies(agree(reg, 1))[("a", 1)]["ok"] is True


def test_one_uid_keeps_a_bounded_number_of_agreements_and_open_rounds(reg, monkeypatch):
    monkeypatch.setattr(quotas, "MAX_AGREEMENTS_PER_UID", 3)
    monkeypatch.setattr(quotas, "MAX_PENDING_ROUNDS_PER_UID", 4)
    vote = {"rank": 0, "npes": 2, "ok": True, "timeout": None}
    for g in range(3):
        assert reg.agree(("c", g), who(100, 5), {**vote, "group": f"g{g}"}, 0.0) == []
    over = errors(reg.agree(("c", 3), who(100, 5), {**vote, "group": "g3"}, 0.0))[("c", 3)]
    assert over.code is ErrorCode.LIMIT_EXCEEDED and "uid 5 already keeps 3 agreements" in over.message
    assert reg.agree(("o", 0), who(300, 6), {**vote, "group": "g3"}, 0.0) == [], "another uid is not affected"
    assert reg.agree(("c", 4), who(100, 5), {**vote, "group": "g0"}, 0.0) == []  # 4 rounds open now
    full = errors(reg.agree(("c", 5), who(100, 5), {**vote, "group": "g1"}, 0.0))[("c", 5)]
    assert full.code is ErrorCode.LIMIT_EXCEEDED and "4 agreement rounds unsettled" in full.message
    reg.expire(100.0)  # every round times out: nothing is open any more
    assert reg.open_rounds_by_uid == {} and reg.agree(("c", 6), who(100, 5), {**vote, "group": "g1"}, 200.0) == []
    reg.process_died(100, 201.0)  # its only member died after voting: nobody waits on those rounds
    assert reg.open_rounds_by_uid == {} and reg.agreements_by_uid == {6: 1}
    assert reg.next_deadline() is None, "the abandoned round's timer went with it"
    reg.process_died(300, 202.0)
    assert reg.agreements == {} and reg.agreements_by_uid == {}


class CountingDict(dict):
    """A dict that counts the entries its walks visit."""

    visited = 0

    def __iter__(self):
        CountingDict.visited += len(self)
        return super().__iter__()

    def items(self):
        CountingDict.visited += len(self)
        return super().items()

    def values(self):
        CountingDict.visited += len(self)
        return super().values()


def test_pipelined_votes_cost_linear_work(reg):
    """Each vote walks a bounded number of rounds, however many a rank sends before its peer answers."""
    agree(reg, 0)
    agreement = reg.agreements[(None, "a")]
    agreement.rounds = CountingDict(agreement.rounds)
    CountingDict.visited = 0
    votes = 3000
    for _ in range(votes):
        agree(reg, 0)
        assert len(agreement.rounds) <= MAX_RUN_AHEAD
    for _ in range(votes):
        agree(reg, 1)
        agree(reg, 0)
    assert CountingDict.visited <= 10 * votes


def test_only_the_process_holding_a_rank_votes_for_it(reg):
    """A forked child voting with its parent's rank is refused; the group's rounds go on unharmed."""
    live_set(reg)  # ranks 0 and 1 of group "g" held by pids 100 and 101
    child = reg.agree(("child", 0), who(555), {"group": "g", "rank": 0, "npes": 2, "ok": True, "timeout": None}, 0.0)
    refused = errors(child)[("child", 0)]
    assert refused.code is ErrorCode.NOT_MEMBER and "held by pid 100" in refused.message
    assert reg.agreements == {}, "the refused vote left no trace"
    assert agree(reg, 0, group="g") == []
    assert bodies(agree(reg, 1, group="g")) == {("a", 0): {"ok": True, "reason": ""}, ("a", 1): {"ok": True, "reason": ""}}


def test_evict_frees_held_memory_and_fails_waiters(reg, mem):
    """The memory goes with the pids that may still map it: those the handles went to (a set that was
    still joining went to none), so none of it reaches the driver while they live (peerd.arena)."""
    live_set(reg)
    join(reg, 0, npes=2, pid=300, name="other")
    agree(reg, 0, group="g")
    out, evicted = reg.evict("g", None)
    assert sorted(e["name"] for e in evicted) == ["n", "other"] and evicted[0]["holders"]
    assert mem.live == {} and reg.sets == {} and reg.agreements == {}
    assert sorted(mem.mapped_by.values()) == [[], [100, 101], [100, 101]]
    assert errors(out)[("c", 0)].code is ErrorCode.GROUP_FAILED
    assert bodies(out)[("a", 0)]["ok"] is False


def test_evicting_one_set_of_a_group_leaves_its_agreement_in_step(reg):
    """The k-th calls of the ranks pair up whatever is evicted beside them: an eviction of one set of
    several (or of a name that matches none) failed the group's pending round for one rank and restarted
    the count, so rank 1's first call met rank 0's second."""
    for name in ("a", "b"):
        for r in range(2):
            join(reg, r, name=name)
        for r in range(2):
            commit(reg, r, name=name)
    vote = {"group": "g", "npes": 2, "ok": True, "timeout": None}
    assert reg.agree(("x", 0), who(100), {**vote, "rank": 0}, 0.0) == []
    for name in ("none-such", "b"):
        out, evicted = reg.evict("g", name)
        assert out == [] or all(send.caller[0] != "x" for send in out), "rank 0's round stays pending"
    assert [s.state.value for s in reg.all_sets()] == ["live"]
    out = reg.agree(("y", 1), who(101), {**vote, "rank": 1}, 0.0)
    assert bodies(out) == {("x", 0): {"ok": True, "reason": ""}, ("y", 1): {"ok": True, "reason": ""}}


def test_a_process_taking_a_rank_that_left_starts_after_the_rounds_its_last_voter_entered(reg):
    """Pid 100 votes round 1, then releases (it left); pid 110 takes rank 0: it entered round 1 too and
    took over pid 100's wait there, which was never answered. It starts at round 2 now, and pid 100
    hears its round's verdict."""
    live_set(reg)
    vote = {"group": "g", "rank": 0, "npes": 2, "ok": True, "timeout": None}
    assert reg.agree(("old", 0), who(100), vote, 0.0) == []
    release(reg, 0)
    reg.expire(LEAVE_GRACE_S + 1)  # rank 0 has left the group's agreement
    assert reg.agree(("new", 0), who(110), vote, LEAVE_GRACE_S + 2) == []
    out = reg.agree(("peer", 1), who(101), {**vote, "rank": 1}, LEAVE_GRACE_S + 3)
    assert bodies(out) == {("old", 0): {"ok": True, "reason": ""}, ("peer", 1): {"ok": True, "reason": ""}}


def test_a_voter_whose_rank_was_handed_over_hears_its_round_end_when_the_agreement_does(reg):
    """Pid 111 votes rank 1 holding nothing; pid 101 joins a set as rank 1 and votes for it from then on.
    When pid 101 dies the agreement has no live member and goes: pid 111, still waiting in round 1,
    was dropped with it unanswered."""
    vote = {"group": "g", "rank": 1, "npes": 2, "ok": True, "timeout": None}
    assert reg.agree(("stray", 1), who(111), vote, 0.0) == []
    join(reg, 1, pid=101, timeout=30.0)
    assert reg.agree(("member", 1), who(101), vote, 0.0) == []
    out = reg.process_died(101, 1.0)
    assert bodies(out)[("stray", 1)]["ok"] is False and reg.agreements == {}
    assert "every member" in bodies(out)[("stray", 1)]["reason"]


def test_a_one_rank_set_waiting_for_its_memory_times_out_like_any_other(reg):
    """The rendezvous timer was armed only while ranks were missing: a set of one rank whose memory the
    backend was still reserving waited without a deadline, its join unanswered and its buffer held."""
    reg._sets._ready = lambda allocation: False  # the backend never has it ready
    assert join(reg, 0, npes=1, timeout=5.0) == []
    out = reg.expire(6.0)
    timed_out = errors(out)[("c", 0)]
    assert timed_out.code is ErrorCode.TIMEOUT and "still being reserved" in timed_out.message, timed_out


def test_finished_waits_leave_no_timers_behind(reg, mem):
    """A busy daemon must not grow: every settled wait drops its timer at once."""
    for cycle in range(500):
        live_set(reg)
        release(reg, 0), release(reg, 1)
        agree(reg, 0), agree(reg, 1)
    assert reg._timers._checks == {} and len(reg._timers._heap) <= 64, "timers of finished waits are dropped"
    assert mem.live == {} and reg.sets == {}


def test_a_rank_releasing_before_it_voted_fails_the_others_at_once(reg):
    join(reg, 0), join(reg, 1)
    commit(reg, 0)
    out = reg.release(("r", 1), who(101), {"group": "g", "name": "n", "rank": 1}, 1.0)
    verdict = bodies(out)[("v", 0)]
    assert verdict["ok"] is False and "rank 1 (pid 101)" in verdict["reason"] and "released before" in verdict["reason"]


def test_single_rank_sets_leave_no_timers(reg):
    for _ in range(100):
        join(reg, 0, npes=1), commit(reg, 0), release(reg, 0)
    assert reg._timers._checks == {}


def test_a_late_rank_hears_a_failure_for_as_long_as_the_longest_timeout(reg):
    join(reg, 0, npes=3, timeout=300)
    reg.expire(300.0)  # the rendezvous times out at t=300, past the daemon's default of 10
    late = errors(join(reg, 2, npes=3, now=400.0))[("c", 2)]
    assert late.code is ErrorCode.TIMEOUT, "the verdict outlives the daemon's default timeout"


def test_a_failing_free_does_not_strand_the_rest(reg, mem):
    live_set(reg, npes=3)
    real_free, calls = mem.free, []

    def flaky(allocation, mapped_by):
        calls.append(allocation.handle)
        if len(calls) == 1:
            raise RuntimeError("cudaErrorIllegalAddress")
        real_free(allocation, mapped_by)

    reg._sets._free = flaky
    for r in range(3):
        release(reg, r)
    assert len(calls) == 3 and reg.sets == {} and reg.bytes_by_device == {}


def test_listing_shows_state_ranks_and_pids(reg):
    join(reg, 0, now=1.0)
    (entry,), _ = reg.listing(3.5, None)
    assert entry["state"] == "joining" and entry["joined"] == [0] and entry["pids"] == {"0": 100}
    assert entry["age_s"] == 2.5 and entry["bytes_allocated"] == 64


def test_a_sets_memory_goes_to_the_pid_holding_a_rank_once_the_handles_went_out(reg):
    """The fd channel's check: not before the rendezvous ends, not to another pid, not after a failure."""
    slot = {"group": "g", "name": "n", "rank": 0}
    join(reg, 0)
    with pytest.raises(ProtocolError) as early:
        reg.opened_set(slot, who(100))
    assert early.value.code is ErrorCode.BAD_REQUEST and "has not sent its handles" in early.value.message
    join(reg, 1)
    assert reg.opened_set(slot, who(100)).state is State.OPENING
    with pytest.raises(ProtocolError) as other:
        reg.opened_set(slot, who(999))
    assert other.value.code is ErrorCode.NOT_MEMBER and "belongs to pid 100" in other.value.message
    commit(reg, 0, ok=False)
    commit(reg, 1)
    with pytest.raises(ProtocolError) as failed:
        reg.opened_set(slot, who(100))
    assert failed.value.code is ErrorCode.GROUP_FAILED


def withdraw(reg, rank, npes=3, pid=None, now=0.0):
    body = {"group": "g", "name": "n", "rank": rank, "npes": npes, "reason": "BackendUnavailable: no CUDA"}
    return reg.withdraw(("w", rank), who(pid if pid is not None else 100 + rank), body, now)


def test_a_withdrawn_rank_fails_the_waiting_ranks_now_and_the_late_ones_on_arrival(reg, mem):
    assert join(reg, 1, npes=3) == []
    out = withdraw(reg, 0)
    errors = {s.caller: s.error for s in out if s.error}
    assert errors[("c", 1)].code is ErrorCode.GROUP_FAILED and "rank 0 (pid 100)" in errors[("c", 1)].message
    assert "cannot take part: BackendUnavailable: no CUDA" in errors[("c", 1)].message
    assert [s.body for s in out if s.caller == ("w", 0)] == [{}]
    assert mem.live == {}, "rank 1's buffer is freed with the failed rendezvous"
    (late,) = join(reg, 2, npes=3)
    assert late.error.code is ErrorCode.GROUP_FAILED and "cannot take part" in late.error.message
    assert reg.all_sets() == [], "forgotten once every rank heard it"


def test_a_withdrawal_before_anyone_joined_is_kept_for_the_ranks_to_come(reg):
    withdraw(reg, 2)
    for rank in (0, 1):
        (verdict,) = join(reg, rank, npes=3)
        assert verdict.error.code is ErrorCode.GROUP_FAILED, verdict


def test_a_relaunchs_withdrawal_is_its_own_verdict_not_the_old_launchs(reg):
    """The old launch timed out waiting for rank 1 and its ranks 0 and 2 heard it; one of its processes still
    runs. The relaunch's rank 0 withdraws: its own reason is the verdict, not the old one (its rank 1 was told
    the old launch's error, naming dead pids, and its rank 2 then waited out a rendezvous alone)."""
    join(reg, 0, npes=3), join(reg, 2, npes=3)
    assert set(errors(reg.expire(10.0))) == {("c", 0), ("c", 2)}
    withdraw(reg, 0, pid=200)
    for rank in (1, 2):
        told = errors(join(reg, rank, npes=3, pid=200 + rank, now=11.0))[("c", rank)]
        assert told.code is ErrorCode.GROUP_FAILED and "rank 0 (pid 200)" in told.message, told


def test_a_rank_held_in_a_live_set_cannot_withdraw_from_it(reg):
    join(reg, 0), join(reg, 1)
    commit(reg, 0), commit(reg, 1)
    (refused,) = withdraw(reg, 0, npes=2)
    assert refused.error.code is ErrorCode.RANK_TAKEN


def test_kept_verdicts_are_bounded_per_uid_oldest_forgotten_first(mem):
    """Failing sets on purpose (withdrawals of fresh groups) keeps at most --max-groups-per-uid verdicts
    of that uid; another uid's verdicts and sets are untouched."""
    reg = Registry(mem.allocate, mem.free, limits=Limits(max_groups=8, max_groups_per_uid=3))
    body = {"name": "n", "rank": 0, "npes": 2, "reason": "no CUDA"}
    reg.withdraw(("o", 0), who(500, 2), {**body, "group": "other"}, 0.0)
    for g in range(10):
        reg.withdraw(("w", g), who(100, 1), {**body, "group": f"g{g}"}, 0.0)
    assert sorted(b.group for b in reg.all_sets() if b.owner_uid == 1) == ["g7", "g8", "g9"]
    assert [b.group for b in reg.all_sets() if b.owner_uid == 2] == ["other"]
    (late,) = reg.join(("c", 1), who(101, 1), {"group": "g9", "name": "n", "rank": 1, "npes": 2, "nbytes": 64,
                                               "device": "d", "flags": 0, "timeout": None}, 0.0)
    assert late.error.code is ErrorCode.GROUP_FAILED, "a kept verdict still reaches its late rank"
    assert reg.next_deadline() is not None and len(reg.all_sets()) == 3, "g9 heard by both: forgotten"


def test_a_kept_verdict_replaced_or_evicted_leaves_the_uids_other_verdicts_kept(mem):
    """A withdrawal that supersedes a kept verdict replaces it, and an eviction keeps none: neither may
    push another group's verdict out of the uid's share."""
    reg = Registry(mem.allocate, mem.free, limits=Limits(max_groups=8, max_groups_per_uid=2))
    body = {"name": "n", "rank": 0, "npes": 2, "reason": "no CUDA"}
    for group in ("gx", "g0", "g0"):
        reg.withdraw(("w", group), who(100, 1), {**body, "group": group}, 0.0)
    reg.join(("j", 0), who(100, 1), {"group": "gy", "name": "n", "rank": 0, "npes": 2, "nbytes": 64, "device": "d",
                                     "flags": 0, "timeout": None}, 0.0)
    reg.evict("gy", None)
    assert sorted(b.group for b in reg.all_sets()) == ["g0", "gx"]
    late = {"group": "gx", "name": "n", "rank": 1, "npes": 2, "nbytes": 64, "device": "d", "flags": 0, "timeout": None}
    (verdict,) = reg.join(("c", 1), who(101, 1), late, 0.0)
    assert verdict.error.code is ErrorCode.GROUP_FAILED


def test_a_rank_that_released_while_its_peers_hold_the_set_has_left_their_agreement(reg):
    """As on the control page: a second after a release, if its peers still hold the set, the rounds
    the departed rank is missing are False with the reason, now and later, until it votes again."""
    live_set(reg)
    agree(reg, 0, group="g"), agree(reg, 1, group="g")  # round 1, both voted: rank 1 is a known member
    agree(reg, 0, group="g")  # rank 0 waits in round 2
    assert bodies(release(reg, 1)) == {("r", 1): {"freed": False}}
    assert bodies(reg.expire(0.5)) == {}, "within the grace, a rank that released may still vote"
    waiting = bodies(reg.expire(LEAVE_GRACE_S))[("a", 0)]
    assert waiting["ok"] is False and "rank 1 (pid 101) released group=g name=n" in waiting["reason"], waiting
    assert "left the group" in waiting["reason"]
    later = bodies(agree(reg, 0, group="g"))[("a", 0)]
    assert later["ok"] is False and "left the group" in later["reason"], "no waiting on a rank that left"
    assert agree(reg, 1, group="g") == [], "it votes again: the round after its peer's"
    assert bodies(agree(reg, 0, group="g"))[("a", 0)] == {"ok": True, "reason": ""}


def test_a_rank_that_left_before_the_groups_first_round_is_absent_from_it(reg):
    """Its leave was recorded in the group's agreement only if one was kept already: the first round its
    peers entered after it left waited out the whole agreement timeout for it."""
    live_set(reg)
    release(reg, 1)
    reg.expire(LEAVE_GRACE_S + 0.1)
    first = bodies(agree(reg, 0, group="g", now=2.0))[("a", 0)]
    assert first["ok"] is False and "rank 1 (pid 101) released group=g name=n" in first["reason"], first
    assert agree(reg, 1, group="g") == [], "it votes again: the round after its peer's"
    assert bodies(agree(reg, 0, group="g"))[("a", 0)] == {"ok": True, "reason": ""}


def test_a_rank_that_released_one_set_of_its_group_but_holds_another_has_not_left(reg):
    live_set(reg)
    for r in range(2):
        join(reg, r, name="second")
    for r in range(2):
        commit(reg, r, name="second")
    agree(reg, 0, group="g"), agree(reg, 1, group="g")
    agree(reg, 0, group="g")
    release(reg, 1)
    assert bodies(reg.expire(LEAVE_GRACE_S)) == {}, "rank 1 still holds a set of the group: it may still vote"
    assert bodies(agree(reg, 1, group="g"))[("a", 0)]["ok"] is True


def test_ranks_that_all_release_within_the_grace_leave_nobody(reg):
    live_set(reg)
    agree(reg, 0, group="g"), agree(reg, 1, group="g")
    release(reg, 1), release(reg, 0)
    assert bodies(reg.expire(LEAVE_GRACE_S)) == {}
    assert agree(reg, 0, group="g") == [], "nobody held the set after the grace: nobody left anyone"


def test_a_rank_that_left_and_joins_a_new_set_of_the_group_takes_part_in_its_next_round(reg):
    """The group is rebuilt: its ranks closed more than a second apart, so the first to close had left;
    joining the new set brings it back, so the new set's first round is a real one."""
    live_set(reg)
    agree(reg, 0, group="g"), agree(reg, 1, group="g")
    release(reg, 1)
    reg.expire(LEAVE_GRACE_S)  # rank 0 still held it: rank 1 left
    release(reg, 0)
    for r in range(2):
        join(reg, r, name="again")
    for r in range(2):
        commit(reg, r, name="again")
    assert agree(reg, 0, group="g") == [], "the rank back in the group is waited for"
    verdict = bodies(agree(reg, 1, group="g"))
    assert verdict[("a", 0)] == verdict[("a", 1)] == {"ok": True, "reason": ""}


def vote_as(reg, rank, pid, caller=None, group="g"):
    body = {"group": group, "rank": rank, "npes": 2, "ok": True, "timeout": None}
    return reg.agree(caller or ("a", rank), who(pid), body, 0.0)


def rebuild(reg, pids, name="again"):
    """A new set of group g, each rank joined by the pid given."""
    for rank, pid in enumerate(pids):
        join(reg, rank, name=name, pid=pid)
    for rank, pid in enumerate(pids):
        commit(reg, rank, name=name, pid=pid)


def test_a_new_process_in_a_dead_ranks_place_takes_part_from_its_join(reg):
    """A new process joins a set of the group in place of a dead rank: the survivor's next round waits for
    it. It was False ("rank 1 died") until the newcomer voted, and the newcomer's first vote then met the
    survivor's second round."""
    live_set(reg)
    vote_as(reg, 0, 100), vote_as(reg, 1, 101)
    reg.process_died(101, 1.0)
    release(reg, 0)
    rebuild(reg, [100, 201])
    assert vote_as(reg, 0, 100) == [], "the newcomer is waited for"
    verdict = bodies(vote_as(reg, 1, 201))
    assert verdict == {("a", 0): {"ok": True, "reason": ""}, ("a", 1): {"ok": True, "reason": ""}}, verdict


def test_a_dead_ranks_replacement_counts_once_its_set_opened_not_at_its_join(reg):
    """Counted back at its join, the survivor's rounds waited for a process whose set might never open
    (its rendezvous then timed out too): the survivor hears the death until the new set opens."""
    live_set(reg)
    vote_as(reg, 0, 100), vote_as(reg, 1, 101)
    reg.process_died(101, 1.0)
    join(reg, 1, pid=201)  # the key's new rendezvous: rank 0 (pid 100) still holds the old set
    assert bodies(vote_as(reg, 0, 100)) == {("a", 0): {"ok": False, "reason": "rank 1 (pid 101) died"}}


def test_another_process_may_take_a_rank_a_retired_set_still_holds(reg):
    """A new job's rank 0 (another process) joins while the old job's rank 0 still tears down its retired
    set: refused only to the process that holds the rank there itself."""
    live_set(reg)
    reg.process_died(101, 1.0)
    assert join(reg, 1, pid=201) == []  # the old set retires: pid 100 still holds rank 0 of it
    assert errors(join(reg, 0, pid=200)) == {}


def test_a_process_that_takes_a_released_rank_within_the_grace_votes_for_it(reg):
    """Rank 1's process released, and another took its place in a new set of the group within the grace: the
    rank was still marked as having left (its peers' rounds False), and the newcomer's votes were refused
    (NOT_MEMBER: the rank votes from the first pid) for as long as that process lived."""
    live_set(reg)
    vote_as(reg, 0, 100), vote_as(reg, 1, 101)
    release(reg, 1)
    rebuild(reg, [100, 201])
    assert reg.expire(LEAVE_GRACE_S) == [], "rank 1 is held: nobody left"
    assert vote_as(reg, 0, 100) == []
    verdict = bodies(vote_as(reg, 1, 201))
    assert verdict == {("a", 0): {"ok": True, "reason": ""}, ("a", 1): {"ok": True, "reason": ""}}, verdict


def test_a_rank_back_from_leaving_never_enters_a_round_it_entered_already(reg):
    """Its count never goes back: a call still waiting in its round keeps its place and gets its answer."""
    live_set(reg)

    def vote(rank, caller):
        return reg.agree(caller, who(100 + rank), {"group": "g", "rank": rank, "npes": 2, "ok": True,
                                                   "timeout": None}, 0.0)

    assert vote(1, "first") == []  # rank 1 waits in round 1 for rank 0
    release(reg, 1)  # another thread of it closed the buffer
    reg.expire(LEAVE_GRACE_S)
    assert vote(1, "second") == [], "round 2, not round 1 again"
    assert bodies(vote(0, "zero-1")) == {"first": {"ok": True, "reason": ""}, "zero-1": {"ok": True, "reason": ""}}
    assert set(bodies(vote(0, "zero-2"))) == {"second", "zero-2"}


def _group_restarted_with_a_new_rank_1(reg):
    """Ranks 0 and 1 (pids 100, 101) agree once on group g and close their set together (within the grace,
    so neither left the agreement); pid 101 lives on, and a new process, pid 201, holds rank 1 of the
    group's next set, which opens; rank 0 waits in the next round."""
    live_set(reg)
    for r in (0, 1):
        reg.agree(("a", r), who(100 + r), {"group": "g", "rank": r, "npes": 2, "ok": True, "timeout": None}, 0.0)
    release(reg, 0)
    release(reg, 1)
    reg.expire(LEAVE_GRACE_S + 0.1)
    join(reg, 0, now=2.0)
    join(reg, 1, now=2.0, pid=201)
    commit(reg, 0, now=2.0)
    commit(reg, 1, now=2.0, pid=201)
    assert reg.agree(("a", 0), who(100), {"group": "g", "rank": 0, "npes": 2, "ok": True, "timeout": None}, 3.0) == []


def test_the_death_of_a_new_process_holding_a_rank_fails_its_peers_round_at_once(reg):
    """The rank's vote stayed with the process that last voted for it while that one lived: the new
    holder's death was nobody's, and rank 0 waited out the 10 s agreement timeout."""
    _group_restarted_with_a_new_rank_1(reg)
    verdict = bodies(reg.process_died(201, 3.5))[("a", 0)]
    assert verdict["ok"] is False and "rank 1 (pid 201) died" in verdict["reason"], verdict


def test_the_exit_of_a_process_that_holds_its_rank_no_more_fails_nothing(reg):
    """The old voter of rank 1 exiting, while the new one held the rank, failed rank 0's round."""
    _group_restarted_with_a_new_rank_1(reg)
    assert reg.process_died(101, 3.5) == []
    verdict = bodies(reg.agree(("a", 1), who(201), {"group": "g", "rank": 1, "npes": 2, "ok": True,
                                                    "timeout": None}, 4.0))
    assert verdict == {("a", 0): {"ok": True, "reason": ""}, ("a", 1): {"ok": True, "reason": ""}}, verdict


@pytest.mark.parametrize("launch_alive, hears_old_verdict", [(True, True), (False, False)])
def test_a_relaunch_after_every_process_of_a_failed_set_exited_starts_afresh(mem, launch_alive, hears_old_verdict):
    """Rank 1 came first with npes=3 (a typo), so the set was of 3 and its MISMATCH verdict was kept for
    rank 2. The job is fixed and relaunched: its ranks got the old launch's error, naming its dead pids,
    or (the rank the verdict was owed to) one of them did while the other waited out a rendezvous."""
    alive = {100, 101} if launch_alive else set()
    reg = Registry(mem.allocate, mem.free, rendezvous_timeout=10, agreement_timeout=10, alive=alive.__contains__)
    join(reg, 1, npes=3)
    assert errors(join(reg, 0, npes=2))[("c", 0)].code is ErrorCode.MISMATCH
    relaunched = errors(join(reg, 2, npes=3, pid=202))
    if hears_old_verdict:  # a late rank of a job still running: the verdict, at once
        assert relaunched[("c", 2)].code is ErrorCode.MISMATCH
        return
    assert relaunched == {}, "a new rendezvous, waiting for its peers"
    join(reg, 0, npes=3, pid=200)
    opened = bodies(join(reg, 1, npes=3, pid=201))
    assert len(opened) == 3 and all("handles" in b for b in opened.values()), opened


def test_a_drain_makes_every_round_false_on_the_message_path_as_the_aborted_pages_do(reg):
    """Groups without a control page (--control-pages false, or a page not made) kept agreeing through a
    drain until their memory was freed under them: only the pages were aborted."""
    assert agree(reg, 0) == [], "rank 0 waits for rank 1"
    stopping = "the peerd daemon is stopping: release this group's buffers within 30s, when it frees them"
    assert bodies(reg.drain(stopping)) == {("a", 0): {"ok": False, "reason": stopping}}
    assert bodies(agree(reg, 1)) == {("a", 1): {"ok": False, "reason": stopping}}
