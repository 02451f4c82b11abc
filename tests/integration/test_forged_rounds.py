"""Forged round words on the control page: a real daemon, real members, and a hostile process that writes them.

A process of a group's uid that holds a rank of any set of that uid is handed the uid's whole page area
(peerd.pages), so it can write every word of every page of its user's sets (Note [Control page layout],
Trust): here it writes the words rounds are made of, where the layout puts them (a rank's round, votes and
mapped words in its slot, a round's verdict entry, the abort word), with the numbers a forger would pick
(a yes for a rank that never voted, rounds far ahead, behind, the largest a word holds, another set's
rounds in a reused slot). Whatever it writes:

* the daemon neither dies nor stalls (``peerd status`` answers), and once every process of a group exited
  it holds nothing of it: no rank, no byte allocated, no memfd, no page area;
* every call of an honest rank ends within its timeout, in a verdict (one for all ranks of a round) or a
  failure that says why, never a hang;
* a process of another uid gets no area of this uid, by the fd channel or through /proc, so it can touch
  none of its pages, and its own forgeries reach none of this uid's groups.
"""

from __future__ import annotations

import errno
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from peerd.controlpage import (
    COMMIT_ROUND,
    MAGIC,
    OFF_ABORT,
    OFF_MAGIC,
    OFF_MAPPED,
    OFF_NPES,
    OFF_VOTES,
    READY,
    REASON_BYTES,
    RING,
    AbortCode,
    Outcome,
    decode_verdict,
    encode_abort,
    encode_verdict,
    page_bytes,
    slot_offset,
    verdict_offset,
)
from peerd.pagearea import AREA_PAGES, MEMFD_NAME
from peerd.paths import fd_socket_path
from tests.conftest import wait_until
from tests.forkserver import popen
from tests.integration.test_arenas import USER_A, USER_B, users  # noqa: F401 (the fixture)
from tests.integration.test_pages import Member, aborted, pages_held, shared_daemon

#: a member's tp_agree timeout, and the longest anything it is asked may take before the test calls it a hang
AGREE_S = 1
ANSWER_WITHIN_S = 30
MAX_WORD = (1 << 64) - 1
ALL_YES = MAX_WORD  # a votes word with every round's bit set

SILENT = """
import json, sys
from peerd_client.connection import connection
joined = connection().call("join", json.loads(sys.argv[1]), timeout=60)
print(json.dumps({"page": joined.get("page"), "set": joined["set"]}), flush=True)
sys.stdin.readline()
"""


class Lines:
    """A process's stdout lines, read on a thread: waiting for one has a deadline, so a hang fails the test."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self._lines = proc, queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put("")

    def next(self) -> dict | None:
        """The next line, as JSON; None once the process closed its stdout (it exited)."""
        try:
            line = self._lines.get(timeout=ANSWER_WITHIN_S)
        except queue.Empty:
            raise AssertionError(f"pid {self.proc.pid} said nothing for {ANSWER_WITHIN_S}s: it hangs") from None
        return json.loads(line) if line else None


class Timed(Member):
    """A page member (tests/page_member.py) whose every answer must come within ANSWER_WITHIN_S."""

    def __init__(self, daemon, group: str, rank: int, npes: int, *args: str):
        super().__init__(daemon, group, rank, npes, "--timeout", str(AGREE_S), "--build-timeout", "10", *args)
        self._said = Lines(self.proc)
        self.where = None

    def read(self) -> dict:
        said = self._said.next()
        assert said is not None, f"member exited {self.proc.wait()}:\n{self.proc.stderr.read()}"
        return said

    def line_or_end(self) -> dict:
        """Its next line, or how it ended (exit status, stderr) where it exited instead."""
        said = self._said.next()
        return said if said is not None else {"exit": self.proc.wait(timeout=30), "stderr": self.proc.stderr.read()}

    def built(self) -> dict:
        """Its first line, once its PeerBuffer is built."""
        ready = self.read()
        assert ready["ready"], ready
        self.page, self.where = ready["page"], ready["where"]
        return ready

    def poke(self, area: int, offset: int, *words: tuple[int, int]) -> None:
        """Forge: each (byte, value) of the page at ``offset`` of ``area``, in order."""
        reply = self.ask(f"poke {area} {offset} " + " ".join(f"{w}={v}" for w, v in words))
        assert reply["ok"], reply

    def peek(self, area: int, offset: int, *words: int) -> list[int]:
        reply = self.ask(f"peek {area} {offset} " + " ".join(map(str, words)))
        assert reply["ok"], reply
        return reply["value"]


def kill_left(procs: list[subprocess.Popen]) -> None:
    """Kill (each by its own pid) what a test started and left running: a failed one."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


@pytest.fixture
def spawned():
    """Every process a test starts, killed if the test left it running."""
    procs: list[subprocess.Popen] = []
    yield procs
    kill_left(procs)


def started(spawned, daemon, group: str, rank: int, npes: int, *args: str) -> Timed:
    member = Timed(daemon, group, rank, npes, *args)
    spawned.append(member.proc)
    return member


def group_of(spawned, daemon, group: str, npes: int, *args: str) -> list[Timed]:
    members = [started(spawned, daemon, group, r, npes, *args) for r in range(npes)]
    for m in members:
        m.built()
    return members


def forger_of(spawned, daemon) -> Timed:
    """A hostile process of the test's uid: a member of a group of its own, so it was handed the uid's area."""
    forger = started(spawned, daemon, "forger", 0, 1)
    assert forger.built()["page"], "the forger maps its uid's area"
    return forger


class Silent:
    """A rank that joins (as a PeerBuffer would) and then does nothing: it never asks for the page, maps
    nothing and never votes, until a line on stdin."""

    def __init__(self, spawned, daemon, group: str, rank: int, npes: int):
        body = {"group": group, "name": "default", "rank": rank, "npes": npes, "nbytes": 1 << 16,
                "device": "host", "flags": 0, "timeout": 10}
        self.proc = popen([sys.executable, "-c", SILENT, json.dumps(body)], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=daemon.env())
        spawned.append(self.proc)
        self._said = Lines(self.proc)

    def page(self) -> list[int]:
        """Where the join reply (once every rank joined) says the set's page is: [area, offset, set]."""
        joined = self._said.next()
        assert joined is not None, f"the silent rank exited {self.proc.wait()}:\n{self.proc.stderr.read()}"
        return joined["page"]


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


def ask_all(members: list[Timed], command: str) -> list[dict]:
    """One command to every member at once (a collective call); their answers, each within its deadline."""
    for m in members:
        m.proc.stdin.write(command + "\n")
        m.proc.stdin.flush()
    return [m.read() for m in members]


def one_verdict(members: list[Timed]) -> bool:
    """A tp_agree round on every member: one verdict for all of them (a round is decided once), a bool."""
    replies = ask_all(members, "agree")
    assert all(r["ok"] and isinstance(r["value"], bool) for r in replies), replies
    assert len({r["value"] for r in replies}) == 1, f"the ranks of one round were told different verdicts: {replies}"
    return replies[0]["value"]


def vote(rank: int, k: int, votes: int, at: int | None = None) -> list[tuple[int, int]]:
    """The words of rank ``rank``'s vote in round ``k`` as its slot holds them (``votes`` the whole votes word),
    in the voter's order: the votes, then the round (``at``: another round number than k)."""
    return [(slot_offset(rank) + OFF_VOTES, votes), (slot_offset(rank), k if at is None else at)]


def status(daemon) -> dict:
    done = daemon.cli("status", "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def nothing_left(daemon) -> None:
    """Every process of the test's groups exited: the daemon is alive, answers, and holds nothing of theirs
    (a failed set may stay listed as a kept verdict, with no rank and no byte)."""

    def empty() -> bool:
        info = status(daemon)
        return info["ranks_held"] == 0 and info["bytes_allocated"] == 0

    wait_until(empty, 20, "the daemon to hold no rank and no byte")
    listed = json.loads(daemon.cli("ls", "--json").stdout)
    assert all(s["held"] == [] and s["bytes_allocated"] == 0 for s in listed), listed
    wait_until(lambda: daemon.settled_segments() == [] and pages_held(daemon.proc.pid) == 0, 20,
               "the daemon to close every memfd and page area")
    assert daemon.proc.poll() is None, daemon.logs()


def live(daemon, group: str) -> None:
    wait_until(lambda: f"group={group} name=default live" in daemon.logs(), 20, f"group {group} to go live")


@pytest.mark.parametrize("marked", [True, False], ids=["marked-mapped", "vote-only"])
def test_a_commit_yes_forged_for_a_rank_that_never_voted_ends_with_its_death_and_frees_everything(
        daemon, spawned, marked):
    """Rank 1 joins and does nothing else; a process of its uid writes its commit yes (and its mapped mark)
    on the page. The forgery makes that set live, which is all it can do: the honest rank agrees with
    nobody (on the page, where rank 1 was marked mapped, else on the daemon's messages), rank 1's death
    fails it with the reason, and once every process exited the daemon holds nothing."""
    forger = forger_of(spawned, daemon)
    rank0 = started(spawned, daemon, "victim", 0, 2)
    rank1 = Silent(spawned, daemon, "victim", 1, 2)
    area, offset, _ = rank1.page()
    assert area == forger.where["area"], "one uid, one page size: the forger holds the victim's area"
    forged = vote(1, COMMIT_ROUND, 1 << COMMIT_ROUND % 2)
    forger.poke(area, offset, *([(slot_offset(1) + OFF_MAPPED, READY)] if marked else []), *forged)
    assert rank0.built()["page"] is marked, "the group keeps the page only where every rank is marked mapped"
    live(daemon, "victim")
    kill(rank1.proc)
    if marked:
        said = aborted(rank0)["message"]
        assert "MEMBER_DIED" in said and f"rank 1 (pid {rank1.proc.pid})" in said, said
    assert rank0.ask("agree") == {"ok": True, "value": False}, "its only peer died"
    assert rank0.ask("close")["ok"]
    said = rank0.end()
    if not marked:
        assert f"rank 1 (pid {rank1.proc.pid})" in said and "died" in said, said
    forger.end()
    nothing_left(daemon)


def placed(forger: Timed, npes: int) -> int:
    """The offset of the first page of ``npes`` ranks, other than the forger's own, in the forger's area: a
    forger need not be told where a set's page is, it can look."""
    area, found = forger.where["area"], []

    def look() -> bool:
        for offset in range(0, AREA_PAGES * page_bytes(1), page_bytes(1)):
            header = forger.peek(area, offset, OFF_MAGIC, OFF_NPES)
            if offset != forger.where["offset"] and header == [MAGIC, npes]:
                found.append(offset)
                return True
        return False

    wait_until(look, 20, f"a page of {npes} ranks to be placed")
    return found[0]


def test_a_rank_whose_own_mapping_failed_is_not_told_its_set_opened_by_a_commit_yes_forged_for_it(
        daemon, spawned):
    """Rank 1 fails to map its peers and says so by message, a moment after the handles went out; before
    that, a forger wrote its commit yes on the page, so rank 0 agreed there and the daemon settled the set
    live. Rank 1's own failure must still be its outcome (MonoUnsupported with the cause), not a PeerBuffer
    that maps no peer."""
    forger = forger_of(spawned, daemon)
    rank0 = started(spawned, daemon, "failing", 0, 2)
    rank1 = started(spawned, daemon, "failing", 1, 2, "--peers-fail-after", "2")
    offset = placed(forger, 2)
    forger.poke(forger.where["area"], offset, *vote(1, COMMIT_ROUND, 1 << COMMIT_ROUND % 2))
    assert rank0.built()["page"] is False, "agreed on the page, where rank 1 is not marked mapped"
    live(daemon, "failing")  # before rank 1's no can come
    outcome = rank1.line_or_end()
    assert outcome.get("exit") not in (None, 0) and "MonoUnsupported" in outcome["stderr"] and \
        "mmap of a peer's buffer failed" in outcome["stderr"], \
        f"rank 1 could not map its peers, yet its PeerBuffer was built: {outcome}"
    rank0.ask("close")
    for m in (rank0, forger):
        m.end()
    nothing_left(daemon)


def test_rounds_forged_far_ahead_behind_or_at_the_largest_word_end_in_one_verdict_each_never_a_hang(
        daemon, spawned):
    """Rank 2 never votes; a forger keeps its slot at the largest round a word holds, with every vote yes,
    so every round counts it; then behind (0), where rounds time out; then the next rounds' verdict entries
    far ahead (a later round's: forgotten, False) and at the largest word (garbage, decided over). Each
    round is one verdict for both honest ranks, within their timeout."""
    forger = forger_of(spawned, daemon)
    ranks = [started(spawned, daemon, "rounds", r, 3) for r in range(2)]
    rank2 = Silent(spawned, daemon, "rounds", 2, 3)
    area, offset, _ = rank2.page()
    forger.poke(area, offset, (slot_offset(2) + OFF_MAPPED, READY), *vote(2, MAX_WORD, ALL_YES))
    assert [m.built()["page"] for m in ranks] == [True, True]
    live(daemon, "rounds")
    k = COMMIT_ROUND
    for _ in range(2):  # rank 2 is past every round, and voted yes in each
        k += 1
        assert one_verdict(ranks) is True
    forger.poke(area, offset, *vote(2, MAX_WORD, ALL_YES, at=0))  # behind: it voted in no round
    k += 1
    assert one_verdict(ranks) is False
    forger.poke(area, offset, *vote(2, MAX_WORD, ALL_YES))
    k += 1
    forger.poke(area, offset, (verdict_offset(k), encode_verdict(k + RING, Outcome.AGREED, 2)))  # a later round's
    assert one_verdict(ranks) is False, "round k's entry shows a later round: k was settled and forgotten"
    k += 1
    forger.poke(area, offset, (verdict_offset(k), MAX_WORD))  # no round at all
    assert one_verdict(ranks) is True, "every rank voted yes, so the garbage entry is decided over"
    (entry,) = forger.peek(area, offset, verdict_offset(k))
    assert decode_verdict(entry)[:2] == (k, Outcome.AGREED), hex(entry)
    assert status(daemon)["ranks_held"] == 3 + 1, "the daemon answers throughout (the forger holds a rank too)"
    kill(rank2.proc)
    for m in ranks:
        assert "MEMBER_DIED" in aborted(m)["message"]
        assert m.ask("close")["ok"]
    said = [m.end() for m in ranks]
    assert all("timed out waiting for rank(s) [2]" in s for s in said), said
    assert all(f"is more than {RING} rounds behind" in s for s in said), said
    forger.end()
    nothing_left(daemon)


def test_an_opening_set_whose_every_slot_is_forged_past_its_commit_goes_live_and_its_deaths_free_it(
        daemon, spawned):
    """No rank of the set maps or votes; the forger writes every slot's round at the largest word. The
    daemon reads the commit round off the page (every slot past it) and settles the set live: only that set
    of the forger's own uid, and it still frees it by who holds it, once they die."""
    forger = forger_of(spawned, daemon)
    ranks = [Silent(spawned, daemon, "hollow", r, 2) for r in range(2)]
    area, offset, _ = [rank.page() for rank in ranks][0]
    forger.poke(area, offset, *vote(0, MAX_WORD, 0), *vote(1, MAX_WORD, 0))
    live(daemon, "hollow")
    (listed,) = [s for s in json.loads(daemon.cli("ls", "--json").stdout) if s["group"] == "hollow"]
    assert listed["state"] == "live" and listed["held"] == [0, 1], listed
    for rank in ranks:
        kill(rank.proc)
    forger.end()
    nothing_left(daemon)


def test_words_a_stale_member_writes_into_its_freed_slot_never_reach_the_set_that_reuses_it(daemon, spawned):
    """A member keeps its uid's area mapped after its set was freed, so it can still write into its old
    slot, before and after another set of the uid takes it. Written before, its words (an abort, both
    slots past every round with their votes, round 1 decided no) are zeroed away with the slot; written
    after (its old rounds, then an abort whose reason does not fit), they spoil the new set's rounds as any
    forger of the uid could, one verdict a round, and its abort is a failure that says so."""
    old = group_of(spawned, daemon, "old", 2)
    assert one_verdict(old) is True
    stale, (area, offset) = old[0], (old[0].where["area"], old[0].where["offset"])
    assert [r["ok"] for r in ask_all(old, "close")] == [True, True]
    wait_until(lambda: "group=old name=default freed" in daemon.logs(), 20, "the old set to be freed")
    free_slot = [(OFF_ABORT, encode_abort(AbortCode.MEMBER_ABORTED, b"stale")),
                 (verdict_offset(COMMIT_ROUND), encode_verdict(COMMIT_ROUND, Outcome.VOTED_NO, 1))]
    for rank in (0, 1):
        free_slot += [(slot_offset(rank) + OFF_MAPPED, READY), *vote(rank, MAX_WORD, 0)]
    stale.poke(area, offset, *free_slot)
    new = group_of(spawned, daemon, "new", 2)
    assert all((m.where["inode"], m.where["offset"]) == (stale.where["inode"], offset) for m in new), \
        "the freed slot is the next one taken"
    assert [m.page for m in new] == [True, True] and one_verdict(new) is True, "round 1 of a zeroed page"
    assert [r["ok"] for r in ask_all(new, "check")] == [True, True], "no abort left over"
    stale.poke(area, offset, *vote(0, COMMIT_ROUND + 2, 0))  # its rank 0's next round of the old set: a no
    one_verdict(new)  # a yes or that no, as the race between the forger and the rank's own vote went
    stale.poke(area, offset, (OFF_ABORT, encode_abort(AbortCode.MEMBER_ABORTED, bytes(REASON_BYTES + 1))))
    for m in new:
        said = aborted(m)["message"]
        assert "aborted (MEMBER_ABORTED); its reason was overwritten" in said, said
    assert one_verdict(new) is False, "an aborted group agrees on nothing"
    assert [r["ok"] for r in ask_all(new, "close")] == [True, True]
    for m in old + new:
        m.end()
    nothing_left(daemon)


STRANGER = """
import json, os, sys
from peerd.fdchannel import fetch_fds
from peerd.protocol import ProtocolError

who, fd_socket, group, paths = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
uid, gid, groups = who.split(":")
os.setgroups([int(g) for g in groups.split(",")])
os.setgid(int(gid))
os.setuid(int(uid))
got = {}
for rank in (0, 1):
    try:
        handles, fds = fetch_fds(fd_socket, {"group": group, "name": "default", "rank": rank, "page": True}, 10)
        got[f"rank {rank}"] = f"handed {handles} as fds {fds}"
    except ProtocolError as err:
        got[f"rank {rank}"] = err.code.value
for path in paths:
    try:
        got[path] = f"opened as fd {os.open(path, os.O_RDWR)}"
    except OSError as err:
        got[path] = err.errno
print(json.dumps(got))
"""


def area_fds(pid: int) -> list[int]:
    """The fds of process ``pid`` that are page areas."""
    fds = Path(f"/proc/{pid}/fd")
    return [int(fd) for fd in os.listdir(fds) if os.readlink(fds / fd).startswith(f"/memfd:{MEMFD_NAME}")]


def area_mapping(pid: int) -> str:
    """The address range of process ``pid``'s mapping of a page area, as /proc/PID/map_files names it."""
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return next(line.split()[0] for line in maps if f"/memfd:{MEMFD_NAME}" in line)


def test_another_uid_can_neither_obtain_the_area_nor_reach_the_group_with_its_own_forgeries(
        socket_dir, users, spawned):  # noqa: F811
    """User B knows user A's group and where its page is. The fd channel hands B no area for A's group
    (in B's namespace there is no such set), and /proc opens B neither the daemon's fd of the area, nor A's
    mapping of it, nor A's memory. B's own group of the same name has its page at the same offset of B's
    own area: B forging every word there (a commit no, a verdict, an abort) leaves A's group agreeing."""
    d = shared_daemon(socket_dir)
    try:
        victims = group_of(spawned, d, "victim", 2, "--as-user", users[USER_A])
        (area_fd,) = area_fds(d.proc.pid)
        paths = [f"/proc/{d.proc.pid}/fd/{area_fd}", f"/proc/{victims[0].proc.pid}/map_files/"
                 f"{area_mapping(victims[0].proc.pid)}", f"/proc/{victims[0].proc.pid}/mem"]
        stranger = subprocess.run([sys.executable, "-c", STRANGER, users[USER_B], fd_socket_path(d.socket),
                                   "victim", json.dumps(paths)], capture_output=True, text=True, timeout=60)
        assert stranger.returncode == 0, stranger.stderr
        got = json.loads(stranger.stdout)
        assert got == {"rank 0": "NOT_FOUND", "rank 1": "NOT_FOUND", **{p: got[p] for p in paths}}, got
        assert all(got[p] in (errno.EACCES, errno.EPERM) for p in paths), got
        theirs = group_of(spawned, d, "victim", 2, "--as-user", users[USER_B])
        where = [(m.where["inode"], m.where["offset"]) for m in (victims[0], theirs[0])]
        assert where[0][0] != where[1][0] and where[0][1] == where[1][1], "another area, the same offset"
        area, offset = theirs[0].where["area"], theirs[0].where["offset"]
        for k in range(COMMIT_ROUND, COMMIT_ROUND + 3):
            theirs[0].poke(area, offset, *vote(1, k, 0), (verdict_offset(k), encode_verdict(k, Outcome.VOTED_NO, 1)))
        theirs[0].poke(area, offset, (OFF_ABORT, encode_abort(AbortCode.EVICTED, b"forged")))
        assert "EVICTED" in aborted(theirs[1])["message"], "the forgeries reached B's own group"
        for _ in range(2):
            assert one_verdict(victims) is True
        assert [r["ok"] for r in ask_all(victims, "check")] == [True, True]
        for m in victims + theirs:
            m.end()
        nothing_left(d)
    finally:
        kill_left(spawned)  # a daemon drains no later than its members' exit
        assert d.stop() == 0, d.logs()
