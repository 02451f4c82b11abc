"""The control page wired end to end: a real daemon, real member processes (tests/page_member.py).

Every group whose ranks all mapped the page agrees on it and hears aborts
there; a daemon without pages (or a rank that cannot map one) leaves the
group on the message path with one WARNING; an eviction aborts before it
frees; a restarted daemon never lets an old set's round pass; one member's
garbage reaches only its own group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from peerd.controlpage import MEMFD_NAME
from tests.conftest import wait_until

MEMBER = Path(__file__).resolve().parents[1] / "page_member.py"


class Member:
    def __init__(self, daemon, group: str, rank: int, npes: int, *args: str):
        self.proc = subprocess.Popen(
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
        m.page = r["page"]
    return members


def ask_all(members: list[Member], command: str) -> list[dict]:
    for m in members:
        m.proc.stdin.write(command + "\n")
        m.proc.stdin.flush()
    return [m.read() for m in members]


def pages_held(pid: int) -> int:
    """Control pages process ``pid`` holds open."""
    fds = Path(f"/proc/{pid}/fd")
    return sum(os.readlink(fds / fd).startswith(f"/memfd:{MEMFD_NAME}") for fd in os.listdir(fds))


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
        m.end()


def test_a_daemon_without_pages_keeps_the_message_path_with_one_warning(socket_dir, daemon):
    daemon.stop()
    daemon.args = ("--control-pages", "false")
    daemon.start()
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
    abort = log.index("control page of set 1 aborted: group=evicted name=default was evicted")
    assert abort < log.index("group=evicted name=default freed"), log
    for m in members:
        m.end()


@pytest.mark.parametrize("pages", [True, False], ids=["page", "messages"])
def test_after_a_daemon_restart_a_vote_is_false_or_unavailable_never_true(daemon, pages):
    if not pages:
        daemon.stop()
        daemon.args = ("--control-pages", "false")
        daemon.start()
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
    for m in members:
        m.end()


def test_garbage_in_one_groups_page_leaves_another_group_alone(daemon):
    spoiled, healthy = group_of(daemon, "spoiled", 2, "--timeout", "1"), group_of(daemon, "healthy", 2)
    assert spoiled[0].ask("garbage")["ok"]
    for reply in ask_all(spoiled, "agree"):
        assert reply["ok"] or reply["type"] == "MonoUnsupported", reply  # a verdict or a refusal, no crash or hang
    assert [r["value"] for r in ask_all(healthy, "agree")] == [True, True]
    assert [r["ok"] for r in ask_all(healthy, "check")] == [True, True]
    for m in spoiled + healthy:
        m.end()
    assert daemon.proc.poll() is None


def test_a_vote_with_another_rank_or_npes_than_the_groups_is_refused(daemon):
    members = group_of(daemon, "strict", 2)
    for command in ("agree 1 2", "agree 0 3"):
        refused = members[0].ask(command)
        assert not refused["ok"] and refused["code"] == "MISMATCH", refused
    assert [r["value"] for r in ask_all(members, "agree")] == [True, True]
    for m in members:
        m.end()


@pytest.mark.parametrize("npes", [2, 4])
def test_a_member_that_leaves_aborts_its_peers_and_its_page_is_closed(daemon, npes):
    members = group_of(daemon, f"leaving-{npes}", npes)
    assert members[0].ask("close")["ok"]
    for m in members[1:]:
        assert "MEMBER_LEFT" in aborted(m)["message"]
    for m in members[1:]:
        m.ask("close")
    for m in members:
        m.end()
    wait_until(lambda: daemon.segments() == [] and pages_held(daemon.proc.pid) == 0, 10,
               "the daemon to free the set and close its page")


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
