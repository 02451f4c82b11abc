"""The control page wired end to end: a real daemon, real member processes (tests/page_member.py).

Every group whose ranks all mapped the page agrees on it and hears aborts
there; a process asks for each page area once and holds no fd of it; a
freed slot comes back zeroed, an evicted one only once its holders exited;
a daemon without pages (or a rank that cannot map one) leaves the group on
the message path with one WARNING; an eviction aborts before it frees; a
restarted daemon never lets an old set's round pass; another uid never
gets a uid's area (a uid's groups share theirs), and one member's garbage
reaches no other user's group.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from peerd.pagearea import MEMFD_NAME
from peerd.pages import LEAVE_GRACE_S
from tests.conftest import Daemon, finish, start_rank, wait_until
from tests.forkserver import popen
from tests.integration.test_arenas import SOCKET_GROUP, USER_A, USER_B, users  # noqa: F401 (the fixture)

MEMBER = Path(__file__).resolve().parents[1] / "page_member.py"


class Member:
    def __init__(self, daemon, group: str, rank: int, npes: int, *args: str):
        self.proc = popen(
            [sys.executable, str(MEMBER), "--group", group, "--rank", str(rank), "--npes", str(npes), *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=daemon.env(),
        )

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"member exited {self.proc.wait()}:\n{self.proc.stderr.read()}"
        return json.loads(line)

    def ask(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.read()

    def end(self) -> str:
        """Close stdin, wait for the exit; its stderr."""
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        return self.proc.stderr.read()


def group_of(daemon, group: str, npes: int, *args: str) -> list[Member]:
    members = [Member(daemon, group, r, npes, *args) for r in range(npes)]
    ready = [m.read() for m in members]
    assert all(r["ready"] for r in ready), ready
    for m, r in zip(members, ready):
        m.page, m.where = r["page"], r["where"]
    return members


def ask_all(members: list[Member], command: str) -> list[dict]:
    for m in members:
        m.proc.stdin.write(command + "\n")
        m.proc.stdin.flush()
    return [m.read() for m in members]


def pages_held(pid: int) -> int:
    """Control page areas process ``pid`` holds open as fds."""
    fds, held = Path(f"/proc/{pid}/fd"), 0
    for fd in os.listdir(fds):
        try:
            held += os.readlink(fds / fd).startswith(f"/memfd:{MEMFD_NAME}")
        except OSError:  # closed since the listing (an fd-channel connection): not an area
            pass
    return held


def aborted(member: Member) -> dict:
    """The member's check() once it raises (the daemon acts on its own turn)."""
    seen = {}
    wait_until(lambda: not seen.setdefault("last", member.ask("check"))["ok"] or seen.clear(), 10,
               "the member to see its group aborted")
    return seen["last"]


def test_a_group_agrees_on_its_page_and_hears_a_death_with_the_reason(daemon):
    members = group_of(daemon, "paged", 3)
    assert all(m.page for m in members), "every rank should have taken the page"
    assert [r["value"] for r in ask_all(members, "agree")] == [True] * 3
    victim = members[2]
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait()
    for m in members[:2]:
        checked = aborted(m)
        assert "MEMBER_DIED" in checked["message"] and f"pid {victim.proc.pid}" in checked["message"], checked
    assert [r["value"] for r in ask_all(members[:2], "agree")] == [False, False]
    for m in members[:2]:
        said = m.end()
        assert "tp_agree on group=paged is False: agreement round 2 of group=paged" in said, \
            "the reason numbers the round as the caller counts its calls, not from the page's commit vote"


def without_pages(daemon) -> None:
    """Restart the test's daemon with --control-pages false: every group agrees through its messages."""
    daemon.stop()
    daemon.args = ("--control-pages", "false")
    daemon.start()


def test_a_daemon_without_pages_keeps_the_message_path_with_one_warning(socket_dir, daemon):
    without_pages(daemon)
    members = group_of(daemon, "unpaged", 2)
    assert not any(m.page for m in members)
    assert [r["value"] for r in ask_all(members, "agree")] == [True, True]
    assert [r["ok"] for r in ask_all(members, "check")] == [True, True]
    for err in [m.end() for m in members]:
        assert err.count("has no control page") == 1 and "--control-pages false" in err, err


def test_an_eviction_aborts_the_page_before_it_frees_the_memory(daemon):
    members = group_of(daemon, "evicted", 2)
    assert all(m.page for m in members)
    assert daemon.cli("evict", "evicted", "--yes").returncode == 0
    for m in members:
        assert "EVICTED" in aborted(m)["message"]
    assert [r["value"] for r in ask_all(members, "agree")] == [False, False]
    log = daemon.logs()
    abort = re.search(r"control page of set \d+ aborted: group=evicted name=default was evicted", log).start()
    assert abort < log.index("group=evicted name=default freed"), log
    for m in members:
        m.end()


@pytest.mark.parametrize("pages", [True, False], ids=["page", "messages"])
def test_after_a_daemon_restart_a_vote_is_false_or_unavailable_never_true(daemon, pages):
    if not pages:
        without_pages(daemon)
    members = group_of(daemon, "restarted", 2)
    assert [m.page for m in members] == [pages] * 2
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.proc.wait()
    for m in members if pages else ():  # the alive pipe tells each member the daemon run is gone
        assert "is gone" in aborted(m)["message"]
    daemon.start()
    for _ in range(3):
        for reply in ask_all(members, "agree"):
            assert reply.get("value") is not True, reply
            assert reply["ok"] or reply["type"] == "DaemonUnavailable", reply
    for rank, m in enumerate(members):  # a new set of the group while the old one stays open
        m.proc.stdin.write(f"fresh restarted {rank} 2\n")
        m.proc.stdin.flush()
    fresh = [m.read() for m in members]
    assert [r.get("value") for r in fresh] == [pages] * 2, fresh
    for _ in range(2):  # the new run's set votes; the old one no longer speaks for the group
        assert [r.get("value") for r in ask_all(members, "agree")] == [True, True]
    for m in members:
        m.end()


def test_a_second_buffer_of_a_process_needs_no_page_request_and_a_freed_slot_comes_back_zeroed(daemon):
    members = group_of(daemon, "first", 2)
    assert [m.where["page_fetches"] for m in members] == [1, 1] and [m.where["fds"] for m in members] == [0, 0]
    assert pages_held(members[0].proc.pid) == 0, "the mapping keeps the area: no fd is held"
    assert [r["value"] for r in ask_all(members, "refuse")] == [False, False]  # round 1 settled: VOTED_NO
    first = members[0].where
    assert [r["ok"] for r in ask_all(members, "close")] == [True, True]
    for rank, m in enumerate(members):  # collective: every rank starts before any reads
        m.proc.stdin.write(f"fresh first {rank} 2\n")  # the group's next set: its area is mapped
        m.proc.stdin.flush()
    assert [m.read()["value"] for m in members] == [True, True], "the new set has its page"
    second = [r["value"] for r in ask_all(members, "where")]
    assert all((w["inode"], w["offset"], w["page_fetches"]) == (first["inode"], first["offset"], 1) for w in second), \
        (first, second)  # the freed slot, reused, and no fd-channel request for it
    assert [r["value"] for r in ask_all(members, "agree")] == [True, True], "round 1 of a zeroed page, not the old"
    victim = members[1]
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait()
    assert "MEMBER_DIED" in aborted(members[0])["message"], "the second buffer hears its aborts"
    members[0].end()


def test_an_evicted_sets_slot_is_reused_only_once_its_holders_exited(daemon):
    evicted = group_of(daemon, "evicted-slot", 2)
    assert daemon.cli("evict", "evicted-slot", "--yes").returncode == 0
    for m in evicted:
        assert "EVICTED" in aborted(m)["message"]
    meanwhile = group_of(daemon, "evicted-slot", 2)  # new processes, the same group: its area
    assert meanwhile[0].where["inode"] == evicted[0].where["inode"], "one group, one page size: one area"
    assert meanwhile[0].where["offset"] != evicted[0].where["offset"], "its holders live: the slot is not reused"
    assert [r["value"] for r in ask_all(meanwhile, "agree")] == [True, True]
    for m in evicted:
        m.end()
    wait_until(lambda: "is free again: every process its evicted set was handed to exited" in daemon.logs(), 10,
               "the daemon to see the evicted set's holders exit")
    after = group_of(daemon, "evicted-slot", 2, "--name", "after")
    assert after[0].where["offset"] == evicted[0].where["offset"], "its holders exited: the slot is free"
    assert [r["value"] for r in ask_all(after, "agree")] == [True, True]
    assert [r["ok"] for r in ask_all(after, "check")] == [True, True], "a zeroed page: no EVICTED abort left"
    for m in meanwhile + after:
        m.end()


def shared_daemon(socket_dir: str) -> Daemon:
    """A daemon on a socket the socket group's users reach."""
    os.chmod(socket_dir, 0o755)
    return Daemon(os.path.join(socket_dir, "run", "peerd.sock"), Path(socket_dir) / "daemon.log",
                  args=("--socket-group", SOCKET_GROUP)).start()


def test_another_uid_never_gets_the_first_uids_area(socket_dir, users):  # noqa: F811
    d = shared_daemon(socket_dir)
    try:
        mine = group_of(d, "mine", 2, "--as-user", users[USER_A])
        theirs = group_of(d, "mine", 2, "--as-user", users[USER_B])
        assert {m.where["inode"] for m in mine} != {m.where["inode"] for m in theirs}
        assert len({m.where["inode"] for m in mine + theirs}) == 2, "one area per uid"
        assert pages_held(d.proc.pid) == 2
        for m in mine + theirs:
            m.end()
        wait_until(lambda: pages_held(d.proc.pid) == 0, 10, "the daemon to close both areas")
    finally:
        assert d.stop() == 0, d.logs()


def test_garbage_over_a_members_whole_area_leaves_every_other_users_group_alone(socket_dir, users):  # noqa: F811
    """A member maps its uid's whole area; another user's group is in another area, untouched, and the
    daemon, which trusts one word of a page and only for its own set, survives. A group of the same
    user shares the area and may be spoiled too (as its buffers, in the user's chunks, may be): it gets
    verdicts or refusals, never a crash or a hang."""
    d = shared_daemon(socket_dir)
    try:
        spoiled = group_of(d, "spoiled", 2, "--timeout", "1", "--as-user", users[USER_A])
        healthy = group_of(d, "healthy", 2, "--as-user", users[USER_B])
        neighbours = group_of(d, "neighbours", 2, "--timeout", "1", "--as-user", users[USER_A])
        assert spoiled[0].ask("garbage")["value"] >= spoiled[0].where["offset"] + 4096
        for reply in ask_all(spoiled, "agree"):
            assert reply["ok"] or reply["type"] == "MonoUnsupported", reply  # a verdict or a refusal, no crash or hang
        assert [r["value"] for r in ask_all(healthy, "agree")] == [True, True]
        assert [r["ok"] for r in ask_all(healthy, "check")] == [True, True]
        assert neighbours[0].where["inode"] == spoiled[0].where["inode"], "a group of the same uid: the uid's area"
        for reply in ask_all(neighbours, "agree"):
            assert reply["ok"] or reply["type"] == "MonoUnsupported", reply
        for m in spoiled + healthy + neighbours:
            m.end()
        assert d.proc.poll() is None
    finally:
        assert d.stop() == 0, d.logs()


def test_a_vote_with_another_rank_or_npes_than_the_groups_is_refused(daemon):
    """A vote for a rank this process does not hold counts for nothing; a vote of its own rank with a wrong
    npes is this rank's no in its round, so its peer hears False at once, not at the round's 60 s timeout."""
    members = group_of(daemon, "strict", 2, "--timeout", "60")
    refused = members[0].ask("agree 1 2")
    assert not refused["ok"] and refused["code"] == "MISMATCH", refused
    began = time.monotonic()
    for m, command in zip(members, ("agree 0 3", "agree")):
        m.proc.stdin.write(command + "\n")
        m.proc.stdin.flush()
    wrong, peer = (m.read() for m in members)
    assert not wrong["ok"] and wrong["code"] == "MISMATCH" and "npes=2" in wrong["message"], wrong
    assert peer == {"ok": True, "value": False} and time.monotonic() - began < 30, peer
    assert [r["value"] for r in ask_all(members, "agree")] == [True, True]
    began = time.monotonic()
    alone = members[0].ask("agree 0 3")  # its peer does not come: it waits a moment for it, not the round's 60 s
    assert alone["code"] == "MISMATCH" and time.monotonic() - began < 30, alone
    assert members[1].ask("agree") == {"ok": True, "value": False}, "the round it timed out is False for the peer"
    assert [r["value"] for r in ask_all(members, "agree")] == [True, True]
    for m in members:
        m.end()


@pytest.mark.parametrize("npes", [2, 4])
def test_a_member_that_leaves_aborts_its_peers_and_the_area_is_closed_once_they_exit(daemon, npes):
    members = group_of(daemon, f"leaving-{npes}", npes)
    assert members[0].ask("close")["ok"]
    for m in members[1:]:
        assert "MEMBER_LEFT" in aborted(m)["message"]
    for m in members[1:]:
        m.ask("close")
    for m in members:
        m.end()
    wait_until(lambda: daemon.segments() == [] and pages_held(daemon.proc.pid) == 0, 10,
               "the daemon to free the set and close its area")


def test_a_rank_killed_while_its_peers_wait_in_the_host_all_reduce_makes_them_raise_then_a_new_set_works(daemon):
    members = group_of(daemon, "reducing", 3)
    assert [r["value"] for r in ask_all(members, "reduce")] == [3.0] * 3
    *survivors, victim = members
    for m in survivors:  # they wait in the call for the victim, which never comes
        m.proc.stdin.write("reduce\n")
        m.proc.stdin.flush()
    time.sleep(0.5)
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait()
    for m in survivors:
        raised = m.read()
        assert not raised["ok"] and raised["type"] == "MonoUnsupported", raised
        assert f"rank 2 (pid {victim.proc.pid}) of group=reducing name=default died" in raised["message"], raised
    for rank, m in enumerate(survivors):  # collective: every survivor starts before any reads
        m.proc.stdin.write(f"fresh reducing-again {rank} 2\n")
        m.proc.stdin.flush()
    assert [m.read().get("value") for m in survivors] == [True, True]
    assert [r["value"] for r in ask_all(survivors, "reduce")] == [2.0, 2.0]
    for m in survivors:
        m.end()


def test_a_rank_killed_right_after_its_commit_vote_on_the_page_leaves_a_live_set_that_aborts(daemon):
    """Its peers' round agreed, so they went on: the set is live (the daemon reads the round off the
    page, whether its look or the death comes first: tests/unit/test_pages.py), and the death aborts
    the group like any member's, never failing the set under built buffers."""
    group = "killed-voting"
    procs = [start_rank(daemon, "chaos", r, 3, "--group", group, "--timeout", "4",
                        *(("--die-at", "after_page_vote") if r == 2 else ())) for r in range(3)]
    survivors = [finish(p, timeout=60) for p in procs[:2]]
    assert procs[2].wait(timeout=60) == -signal.SIGKILL, "the victim did not die after its vote"
    for result in survivors:
        assert (result["stage"], result["agreed"], result["page"]) == ("done", False, True), result
        assert result["elapsed"] < 4 + 3, result
    log = daemon.logs()
    assert f"group={group} name=default live" in log and "before it mapped its peers" not in log, log
    assert f"rank 2 (pid {procs[2].pid}) of group={group} name=default died" in log, log
    wait_until(lambda: daemon.segments() == [], 10, "the set to be freed")


@pytest.mark.parametrize("lacking, why", [("--no-map", "Cannot allocate memory"),
                                          ("--no-voter", "compiled voter is not built")])
def test_a_rank_that_cannot_use_the_page_takes_its_whole_group_to_the_message_path_with_one_warning(
        daemon, lacking, why):
    members = [Member(daemon, "half", 0, 2, lacking), Member(daemon, "half", 1, 2)]
    assert [m.read()["page"] for m in members] == [False, False], "every rank takes the same path"
    assert [r["value"] for r in ask_all(members, "agree")] == [True, True]
    unmapped, mapped = [m.end() for m in members]
    assert unmapped.count("has no control page") == 1 and why in unmapped, unmapped
    assert "has no control page" not in mapped, mapped


CYCLE_GROUPS = """
import sys
from peerd_client import PeerBuffer
for i in range(int(sys.argv[1])):
    PeerBuffer(4096, f"cycle-{i}", 0, 1).close()
print("DONE", flush=True)
sys.stdin.readline()
"""


def test_a_process_cycling_through_group_names_is_served_from_one_area(daemon):
    """Every group of a uid has its pages in the uid's area: a process making set after set of new groups
    fetches and maps one area, and the daemon holds one, not one per group."""
    groups = 48
    cycler = subprocess.Popen([sys.executable, "-c", CYCLE_GROUPS, str(groups)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=daemon.env())
    try:
        assert cycler.stdout.readline().strip() == "DONE"
        assert pages_held(daemon.proc.pid) == 1, "an area per group"
        maps = Path(f"/proc/{daemon.proc.pid}/maps").read_text()
        assert maps.count(f"/memfd:{MEMFD_NAME}") == 1
        assert daemon.settled_segments() == [], "every set was freed"
    finally:
        cycler.stdin.close()
        cycler.wait(30)
    wait_until(lambda: pages_held(daemon.proc.pid) == 0, 10, "the daemon to close its spares once the process exits")


@pytest.mark.parametrize("late", [True, False], ids=["after-the-grace", "within-the-grace"])
@pytest.mark.parametrize("pages", [True, False], ids=["page", "messages"])
def test_a_rank_that_left_then_built_another_set_with_its_peer_agrees_with_it_again(daemon, pages, late):
    """Rank 1 closes its buffer and both ranks build another set of the group (another name), rank 0 keeping
    its first: on the page, rank 0 voted on the first set's page, aborted by the departure, and rank 1 on the
    new one, so every round was False and their rounds never lined up again. Moving by the aborted page was
    not enough: built within the grace, rank 0's first vote went to the old page, and the ranks' rounds were
    one apart for good. The daemon tells both, in the new set's join reply, which set it supersedes."""
    if not pages:
        without_pages(daemon)
    stayer, leaver = group_of(daemon, "rejoin", 2, "--timeout", "5")
    assert leaver.ask("close")["ok"]
    if late:
        if pages:
            aborted(stayer)  # the departure reached the page
        else:
            time.sleep(LEAVE_GRACE_S + 0.5)  # and the daemon's agreement
    for member, rank in ((stayer, 0), (leaver, 1)):
        member.proc.stdin.write(f"fresh rejoin {rank} 2 second\n")
        member.proc.stdin.flush()
    assert [m.read() for m in (stayer, leaver)] == [{"ok": True, "value": pages}] * 2
    assert [r["value"] for r in ask_all([stayer, leaver], "agree")] == [True, True]
    stayer.proc.stdin.write("refuse\n")  # one no: False on both ranks, in the same round
    stayer.proc.stdin.flush()
    assert leaver.ask("agree") == {"ok": True, "value": False} and stayer.read() == {"ok": True, "value": False}
    for _ in range(2):
        assert [r["value"] for r in ask_all([stayer, leaver], "agree")] == [True, True]
    if late:
        time.sleep(LEAVE_GRACE_S + 0.5)  # the first set's page aborts meanwhile: nothing changes
        assert [r["value"] for r in ask_all([stayer, leaver], "agree")] == [True, True]
    stayer.end()
    leaver.end()


@pytest.mark.parametrize("pages", [True, False], ids=["page", "messages"])
def test_a_rank_that_releases_while_its_peer_waits_in_tp_agree_ends_the_round_on_either_path(daemon, pages):
    if not pages:
        without_pages(daemon)
    stayer, leaver = group_of(daemon, "departing", 2, "--timeout", "30")
    assert [stayer.page, leaver.page] == [pages] * 2
    assert [r["value"] for r in ask_all([stayer, leaver], "agree")] == [True, True]
    start = time.monotonic()
    stayer.proc.stdin.write("agree\n")  # waits for the leaver's vote, which never comes
    stayer.proc.stdin.flush()
    assert leaver.ask("close")["ok"]
    assert stayer.read() == {"ok": True, "value": False}
    assert time.monotonic() - start < 15, "the departure ended the round, not its 30 s timeout"
    assert stayer.ask("agree") == {"ok": True, "value": False}, "nor does a later round wait for it"
    leaver.end()
    said = stayer.end()
    assert f"rank 1 (pid {leaver.proc.pid})" in said and "released" in said, said


def test_a_drain_aborts_every_live_group_at_once_so_it_can_release_within_the_grace(socket_dir):
    """On SIGTERM live groups heard nothing until the grace ran out and their memory was freed under their
    kernels: tp_agree kept agreeing and check() kept passing, so no engine knew to release."""
    d = Daemon(os.path.join(socket_dir, "peerd.sock"), Path(socket_dir) / "daemon.log",
               args=("--shutdown-grace", "60")).start()
    members = group_of(d, "drained", 2)
    assert all(m.page for m in members)
    d.proc.send_signal(signal.SIGTERM)
    for m in members:
        said = aborted(m)["message"]
        assert "SHUTDOWN" in said and "the peerd daemon is stopping: release this group's buffers within 60s" in said
    assert [r["value"] for r in ask_all(members, "agree")] == [False, False]
    assert [r["ok"] for r in ask_all(members, "close")] == [True, True]
    assert d.proc.wait(timeout=30) == 0, "every set released: the daemon stops well before its grace"
    for m in members:
        m.end()
