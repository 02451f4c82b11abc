"""The group control page: agreement votes and the abort word in one shared page.

The daemon keeps its pages in *areas*: one sealed memfd (no name anyone
could guess or open; peerd.pagearea) of fixed-size slots per (owner uid,
page size), and places each set's page in a slot of its uid's area when
the set's handles go out. A process maps each area it is given once, for
its whole life, so only its first buffer set costs an fd and a mapping
(and, on a GPU, a registration); every later one, of any group of its
user (an engine's signal pads, then its data buffers, its other parallel
groups, or a set rebuilt after a failure) is a ``ControlPage`` view at
area base + offset.
On a page, ``PageVoter.agree`` is tp_agree without a message to the daemon,
and ``ControlPage.abort`` is how the daemon (or a member) fails the whole
group at once: every waiter wakes, and kernels that poll the abort word
(through a device mapping of the area, peerd_client.hostmap) exit.

Standard library only (ctypes, mmap, os, zlib): the daemon and workers both
import it, and neither may pay for torch or zmq here.

Who calls what (peerd.pages on the daemon's side, peerd_client.pagelink on
the member's):

* daemon, when a set's handles go out: ``Area.create(page_bytes(npes))``
  where its owner has no area of that page size with a free slot, then
  ``area.page_at(offset).format(npes, instance, generation)`` (``instance``
  = ``new_instance_id()``, drawn once per daemon run and announced in hello;
  ``generation`` = the set's id; the slot is zeroed first), so a rank that
  replaces a dead one starts on a fresh page with fresh rounds. The join
  reply says where the page is: ``page: [area id, offset, generation]``.
* member, after its join and before its commit vote: where this process
  has not mapped that area yet, it asks the fd channel (``{group, name,
  rank, page: true}``, answered only to a pid holding that rank of an
  OPENING or LIVE set) for the area's fd and the read end of the daemon's
  alive pipe, and ``Area.attach(fd)`` maps it; then ``area.page(offset,
  npes=npes, instance=hello_instance, generation=generation)``,
  ``peerd_client.hostmap.MappedPage`` on a GPU, and ``mark_mapped(rank)``;
  any failure costs one WARNING and keeps the message path. A member that
  holds the page votes its commit there as round 1 (COMMIT_ROUND) with
  ``PageVoter(page, rank, label)``, which then runs tp_agree (round k + 1
  for the k-th call), and posts the vote after only where the round failed
  (``page: true``, ``ok: false`` with the reason, not answered); a member
  without it commits through a message and the daemon writes its yes on
  the page (``vote_for``), or fails the set, aborting the page with the
  reason, on a no. The daemon settles the set live once it reads round 1
  agreed on the page (``round_agreed``, or every slot past it), looking
  soon after the handles went out and at doubling intervals after
  (peerd.rendezvous, COMMIT_LOOK_FIRST_S), and where a yes comes by
  message (a yes the page does not confirm settles nothing); before the
  daemon fails a set still opening (a rank died or left unheard, the
  commit timed out) it closes round 1 (``close_round``), and a round that
  had agreed makes the set live instead: the ranks went on with it. After
  the commit, ``unmapped()`` decides for the group (see "The choice"
  below).
* daemon: ``page.abort(AbortCode.MEMBER_DIED | MEMBER_LEFT | EVICTED |
  SET_FAILED | SHUTDOWN, reason)`` when a member dies or leaves, before an
  evict frees anything, when a set of the group fails, and at shutdown;
  once the set is freed its slot is free again (an evicted set's only once
  every process it was handed to exited: peerd.pages, Note [A slot outlives
  its evicted set]). A member that sees the alive pipe close aborts its
  pages itself: a killed daemon cannot.

Note [Control page layout]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Byte offsets from the page's start (a slot of an area: the area's address
+ k * page_bytes(npes), page-aligned); every word is little-endian and
naturally aligned::

    0     magic        u64  MAGIC ("peerdCP1"): this is a control page
    8     version      u64  VERSION: the layout below
    16    instance     u64  random id of the daemon run that made it
    24    npes         u64  ranks in the group
    32    generation   u64  the group's set generation it was made for
    64    wake         u32  futex word: bumped by every publish, settle and abort
    68    sleepers     u32  ranks inside FUTEX_WAIT (publishers skip the wake when 0)
    128   abort        u64  0, or crc32(reason) << 32 | len(reason) << 16 | code
    136   aborted_at   u64  CLOCK_MONOTONIC ns when the abort was written
    192   reason       256 bytes of UTF-8, the abort reason (len in the abort word)
    448   verdicts     RING u64s: round k's verdict at 448 + 8 * (k % RING),
                            round << 24 | outcome << 16 | rank (0: none yet)
    1024  slot[r]      64 bytes (one cache line) per rank r:
                         +0 round  u64  the last round r voted in
                         +8 votes  u64  bit (k % 2): r's vote in round k
                         +16 mapped u64  READY once r mapped the page, before
                                         its commit vote (see "The choice" below)

Write order and why nobody reads half a write:

* A slot has one writer, its rank (but see the daemon's commit vote
  below). To vote in round k it first stores the vote bit (keeping bit
  (k - 1) % 2, the previous round's vote, intact), then stores
  ``round = k`` with release semantics (sequentially consistent, for the
  wake below). A reader that sees round >= k issues an acquire fence
  before it reads the votes word, so it sees the vote of round k (or of
  k + 1 in the other bit). Aligned 8-byte loads and stores are single
  instructions on x86-64 and arm64 (``mov``/``ldr``/``str`` of an aligned
  u64 are single-copy atomic), so a word is never seen torn, half old and
  half new; the release/acquire pair orders the two words. The round runs
  in C (peerd/_pagevote.c, GCC's ``__atomic`` builtins: acquire loads, a
  sequentially consistent store of the round, compare-and-swap); the few
  words Python writes (the header, ``mapped``, the abort) go through
  ``ctypes.c_uint64.from_address(...).value``, one aligned load or store,
  ordered by libatomic's fences and sequentially consistent stores where
  the CPU needs them (peerd.atomics).
  A rank's votes word holds two rounds because no rank's slot can pass
  round k + 1 before round k is settled (see below), and a rank proposes a
  verdict from the votes only while round k's entry is empty.
* The first abort wins, and its reason stands: an aborter claims the word
  by compare-and-swap from 0 to a claim (length WRITING, the code), which
  every kernel and round already sees as the abort; then it writes the
  reason text and the instant, then the final word (a sequentially
  consistent store, so both precede it), whose crc32 and length describe
  the text. An aborter that finds the word taken writes nothing: two ranks
  that saw the same peer stopped at once both wrote their text, and their
  peers read neither reason (seen in a GPU test). A reader that sees a
  claim waits up to ABORT_TEXT_WAIT_S for the final word (an aborter
  stopped or killed in between leaves the code alone); one that sees the
  final word issues an acquire fence and reads a complete reason; a text
  the crc does not match (a member wrote over it) is reported as
  overwritten, with the code alone. Kernels only test the word for
  non-zero.
* The verdict of round k is decided once, by compare-and-swap (lock-free
  on 8 aligned bytes) into its
  ring entry: the first rank to propose wins and every rank answers what the
  entry says. A rank proposes the AND of the votes once every slot reached
  k, TIMEOUT when its deadline passed first, ABORTED when the abort word is
  set. This is what makes a timeout exactly as on the daemon path: a round
  that timed out is False for every rank, including those that reach it
  later, and a rank can never get True for a round another rank was told
  timed out. Plain loads and stores cannot decide this (two ranks, one
  timing out as the other arrives, would each see what suits them).

The choice: every rank of a set takes the same path, page or messages. A
member that attached the page (and, on a GPU, registered it) stores READY
in its ``mapped`` word before it votes in the commit round; once that round
agreed, every vote, so every such store, happened before any rank reads
the marks, and every rank reads the same ones: all READY, the page; any
missing, messages (a rank without the page has no page to read, and hears
the verdict from the daemon). The commit round is the barrier; the daemon
need not know the choice.

A slot's one writer is its rank, with one exception: the daemon writes the
commit vote (round 1, yes) of a rank that committed through a message,
that is, a rank that has no mapping of the page and so never writes it.

Rounds: the k-th call of a rank's voter is round k (its first is the commit,
so tp_agree's k-th call is round k + 1). A rank passes round k only once
its entry holds a verdict, and a verdict other than TIMEOUT or ABORTED needs
every slot at k, so a rank is at most one round ahead of the slowest one
(it waits), except past rounds that timed out. A rank that timed out in
round k calls again in round k + 1 while a peer is still in round k: the
peer finds round k's verdict TIMEOUT and answers False at once (and so on
for every round that timed out while it was away); round k + 1 then
proceeds normally. A rank more than RING rounds behind the latest
verdict finds its round's entry reused and answers False (the daemon path
keeps 64 settled rounds too).

The wait: spin (``spin_budget``: long where every rank can have a core of
its own, short where ranks share cores and a spinner steals its peer's
time), then FUTEX_WAIT on ``wake`` (a shared futex, not
FUTEX_PRIVATE: the waiters are different processes) until the deadline, in
slices of at most WAIT_SLICE_S, so a waiting rank does not burn a core.
A sleeper reads ``wake``, increments ``sleepers`` (a sequentially consistent
RMW), checks once more, then waits on the value it read. Every change a
waiter waits for (the last vote of a round, a verdict, the abort) is a
sequentially consistent store or CAS followed by a load of ``sleepers``;
only when it is non-zero does the writer bump ``wake`` and call FUTEX_WAKE
(an abort, rare, always does).
Either the writer sees the sleeper, or the sleeper's last check sees the
change (neither load can pass the other side's store: Dekker's argument),
so no wake is lost, and a round without sleepers costs no system call.
Only a vote after which every slot shows the round wakes anyone (waiters
wait for all slots): of two last voters racing, each loads the other's
slot after its own store, so at least one sees both and wakes. So a round
costs one FUTEX_WAKE at most, not one per rank.

Requirements: x86-64 or arm64 Linux, libatomic.so.1 (lock-free 8-byte
operations) and, on a member, the compiled voter (built by ``pip install``
where a C compiler is found); where one is missing, or memfd_create or mmap
fails, PageError says which and the member keeps the daemon's message path.

Trust: every member maps the page read-write, so a member can forge any
answer of its own group's rounds (True included, by writing a peer's slot
or a verdict), time them out, abort the group, or (faking ``sleepers``)
make its peers' votes pay a FUTEX_WAKE each, as a sleeper that died inside
FUTEX_WAIT does. That is no new power: a member already maps every peer's
buffer read-write. It maps its whole area, which holds the pages of its
own user's sets only (of its other groups too, whose buffers share its
user's arena chunks anyway: peerd.arena). It reaches no other user's
group: areas are per (owner uid, page size), and the fd channel hands an
area only to a pid holding a rank of a set placed in it. The daemon reads
the commit round's verdict when it is about to fail a set still opening
(``close_round``), and the slots' round words: where the verdict says AGREED,
or every slot is past the commit round (the ranks' tp_agree rounds went once
round the ring, over its entry), the set goes live instead, which a member
could forge only for its own user's sets; it writes a few words and trusts
nothing else there.
The area is sealed against resizing (a shrunk memfd would SIGBUS the
daemon and the peers). Nor does anyone count ranks by the header once the
page is found: a member checks ``npes`` against its group's then (``hold``),
and loops over slots by that number, so a member rewriting the word later
cannot send a peer's loop past the page.
"""

from __future__ import annotations

import ctypes
import enum
import mmap
import os
import time
import zlib
from dataclasses import dataclass

from .atomics import SEQ_CST, PageError, atomics

MAGIC = int.from_bytes(b"peerdCP1", "little")
VERSION = 2
RING = 64
DAEMON_RANK = 0xFFFF  # the proposer a verdict the daemon decides names
COMMIT_ROUND = 1  # a set's commit vote is its page's round 1, so tp_agree's k-th call is round k + 1
MAX_NPES = 1024
REASON_BYTES = 256
WRITING = 0xFFFF  # the abort word's length while its aborter writes the reason (no reason is that long)
ABORT_TEXT_WAIT_S = 0.05  # how long a reader waits for a claimed abort's reason
SPIN_SHARED_S, SPIN_OWN_CORE_S = 20e-6, 200e-6
WAIT_SLICE_S = 0.05
#: what the fd channel's page answer names its two fds: the set's area, the daemon's alive pipe (peerd.pages)
PAGE_HANDLES = [b"control-area", b"daemon-alive"]

OFF_MAGIC, OFF_VERSION, OFF_INSTANCE, OFF_NPES, OFF_GENERATION = 0, 8, 16, 24, 32
OFF_WAKE, OFF_SLEEPERS = 64, 68
OFF_ABORT, OFF_ABORTED_AT, OFF_REASON = 128, 136, 192
OFF_VERDICTS = 448
OFF_SLOTS = 1024
SLOT_BYTES = 64

ROUND_BITS = 40  # 10^12 rounds: centuries at one round per decode step


class AbortCode(enum.IntEnum):
    """Why a group was aborted: what the daemon writes, what kernels and waiters report."""

    MEMBER_DIED = 1
    EVICTED = 2
    SET_FAILED = 3
    SHUTDOWN = 4
    MEMBER_ABORTED = 5  # a member gave up on its group itself
    MEMBER_LEFT = 6  # a member released its buffers while its peers still hold theirs
    MEMBER_STOPPED = 7  # a member stayed stopped (SIGSTOP, a debugger) past its peers' grace


class Outcome(enum.IntEnum):
    """A round's verdict, as its ring entry stores it (0: not settled)."""

    AGREED = 1
    VOTED_NO = 2
    TIMED_OUT = 3
    ABORTED = 4


class GroupAborted(RuntimeError):
    """The group's abort word is set: ``code`` (AbortCode or a number) and ``reason``."""

    def __init__(self, code: int, reason: str):
        super().__init__(reason)
        self.code, self.reason = code, reason


class StaleInstance(PageError):
    """The page was made by another daemon run than the one this process talks to."""


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str = ""


def page_bytes(npes: int) -> int:
    """The page's size for ``npes`` ranks: whole pages."""
    return -(-(OFF_SLOTS + SLOT_BYTES * npes) // mmap.PAGESIZE) * mmap.PAGESIZE


def spin_budget(npes: int) -> float:
    """Seconds a waiting rank spins before it sleeps: long when this process may
    run on at least two cores per rank, else short (oversubscribed)."""
    return SPIN_OWN_CORE_S if len(os.sched_getaffinity(0)) >= 2 * npes else SPIN_SHARED_S


def new_instance_id() -> int:
    """A daemon run's id: random, 64 bits, never 0."""
    return int.from_bytes(os.urandom(8), "little") | 1


READY = int.from_bytes(b"mapped!!", "little")
OFF_VOTES, OFF_MAPPED = 8, 16  # in a slot


def slot_offset(rank: int) -> int:
    return OFF_SLOTS + SLOT_BYTES * rank


def verdict_offset(k: int) -> int:
    return OFF_VERDICTS + 8 * (k % RING)


def encode_verdict(k: int, outcome: Outcome, rank: int) -> int:
    return (k % (1 << ROUND_BITS)) << 24 | int(outcome) << 16 | rank


def decode_verdict(word: int) -> tuple[int, int, int]:
    """(round, outcome, rank) of a ring entry."""
    return word >> 24, (word >> 16) & 0xFF, word & 0xFFFF


def _agreed(entry: int, k: int) -> bool:
    """Whether the ring entry ``entry`` is round ``k``'s verdict, and says it agreed."""
    return entry != 0 and decode_verdict(entry)[:2] == (k % (1 << ROUND_BITS), Outcome.AGREED)


def encode_abort(code: int, reason: bytes) -> int:
    return zlib.crc32(reason) << 32 | len(reason) << 16 | code


def _claim(code: int) -> int:
    """The abort word while its first aborter writes the reason: Note [Control page layout]."""
    return WRITING << 16 | code


# ---------------------------------------------------------------- areas and pages


class ControlPage:
    """One group's control page: a view of ``size`` bytes at ``address`` of a
    mapped Area, which owns the memory (the view must not outlive it)."""

    def __init__(self, address: int, size: int):
        self.address, self.size = address, size
        self._words: dict[int, ctypes.c_uint64] = {}
        self._npes: int | None = None  # once checked or written: see ``npes``

    def format(self, npes: int, instance: int, generation: int) -> None:
        """Zero the page and write its header (the daemon, placing a set in a free slot)."""
        if not 1 <= npes <= MAX_NPES:
            raise ValueError(f"npes must be in 1..{MAX_NPES}, got {npes}")
        if page_bytes(npes) > self.size:
            raise ValueError(f"a page of npes={npes} needs {page_bytes(npes)} bytes, the slot holds {self.size}")
        ctypes.memset(self.address, 0, self.size)  # magic too: the header counts only once magic shows again
        self._npes = npes
        for offset, value in ((OFF_VERSION, VERSION), (OFF_INSTANCE, instance), (OFF_NPES, npes),
                              (OFF_GENERATION, generation)):
            self.word(offset).value = value
        atomics().store_release(self.word(OFF_MAGIC), MAGIC)  # the header is complete once magic shows

    def word(self, offset: int) -> ctypes.c_uint64:
        """The u64 at ``offset``: ``.value`` is one aligned load or store."""
        w = self._words.get(offset)
        if w is None:
            w = self._words[offset] = ctypes.c_uint64.from_address(self.address + offset)
        return w

    @property
    def version(self) -> int:
        return self.word(OFF_VERSION).value

    @property
    def instance(self) -> int:
        return self.word(OFF_INSTANCE).value

    @property
    def npes(self) -> int:
        """The header's npes until it was checked against the group's (``hold``) or written (``format``);
        that value after: a member may rewrite the header, and a loop over its word could run past the page."""
        return self.word(OFF_NPES).value if self._npes is None else self._npes

    def hold(self, npes: int) -> None:
        """The header says ``npes``, as the group does: from now on every count of ranks is that one."""
        self._npes = npes

    @property
    def generation(self) -> int:
        return self.word(OFF_GENERATION).value

    @property
    def abort_address(self) -> int:
        """Host address of the abort word (non-zero: aborted)."""
        return self.address + OFF_ABORT

    def check_instance(self, instance: int) -> None:
        """Raise StaleInstance unless daemon run ``instance`` made this page."""
        if self.instance != instance:
            raise StaleInstance(
                f"this group's control page was made by daemon instance {self.instance:#x}, but the daemon "
                f"now is instance {instance:#x}: it restarted, so the group's buffers and rounds are gone; "
                f"build the PeerBuffer again"
            )

    # ------------------------------------------------------------ the choice

    def mark_mapped(self, rank: int) -> None:
        """Rank ``rank`` mapped the page: it takes the page path if every rank did."""
        atomics().store_seq_cst(self.word(slot_offset(rank) + OFF_MAPPED), READY)

    def unmapped(self) -> list[int]:
        """Ranks that did not mark the page mapped: the group keeps the message path unless none."""
        missing = [r for r in range(self.npes) if self.word(slot_offset(r) + OFF_MAPPED).value != READY]
        atomics().acquire_fence()
        return missing

    # ------------------------------------------------------------ the commit of a rank without the page

    def vote_for(self, rank: int, k: int, ok: bool) -> None:
        """Rank ``rank``'s vote in round ``k``, written by the daemon for a member that has no mapping
        of the page and voted through a message (its slot's only writer then): the vote, then the
        round, then a wake, in the voter's order (Note [Control page layout])."""
        a, bit = atomics(), 1 << (k % 2)
        votes = self.word(slot_offset(rank) + OFF_VOTES)
        votes.value = (votes.value & ~bit) | (bit if ok else 0)
        a.store_seq_cst(self.word(slot_offset(rank)), k)  # after the vote
        self._wake_sleepers()

    def close_round(self, k: int) -> bool:
        """The daemon decides round ``k`` where no rank has yet: ABORTED, so no rank can pass it once the
        daemon failed the set. True where the round had already agreed (every rank voted yes)."""
        entry = self.word(verdict_offset(k))
        return _agreed(atomics().compare_exchange(entry, 0, encode_verdict(k, Outcome.ABORTED, DAEMON_RANK)), k)

    def every_rank_past(self, k: int) -> bool:
        """Whether every rank's slot shows a vote in a round after ``k``: for the commit round, that it
        agreed, whatever its ring entry holds by now (no rank votes on a page whose commit failed, and
        RING rounds later the entry is a later round's)."""
        return all(self.word(slot_offset(r)).value > k for r in range(self.npes))

    def round_agreed(self, k: int) -> bool:
        """Whether round ``k`` agreed (every rank voted yes), deciding nothing: a rank's word that it
        did is taken only once the page says so."""
        seen = self.word(verdict_offset(k)).value
        atomics().acquire_fence()
        return _agreed(seen, k)

    # ------------------------------------------------------------ abort

    def abort(self, code: int, reason: str) -> bool:
        """Abort the group: claim the word, then the reason text, then the word, then wake every
        waiter. False where the group was aborted already: the first abort's reason stands."""
        if not 0 < code < 1 << 16:
            raise ValueError(f"abort code must be in 1..65535, got {code}")
        text = reason.encode()[: REASON_BYTES - 1].decode(errors="ignore").encode()
        a = atomics()
        if a.compare_exchange(self.word(OFF_ABORT), 0, _claim(code)) != 0:
            return False
        ctypes.memmove(self.address + OFF_REASON, text, len(text))
        self.word(OFF_ABORTED_AT).value = time.monotonic_ns()
        a.store_seq_cst(self.word(OFF_ABORT), encode_abort(code, text))  # after the text and the instant
        self._wake_sleepers()
        return True

    def _wake_sleepers(self) -> None:
        """After a store the waiters must see: bump the wake word (a sleeper's FUTEX_WAIT on its old value
        fails) and wake every sleeper."""
        a = atomics()
        a.add32(self.address + OFF_WAKE, 1, SEQ_CST)
        a.futex_wake(self.address + OFF_WAKE)

    def _abort_word(self) -> int:
        """The abort word, 0 while the group is not aborted; a claim's final word once it is written,
        waiting at most ABORT_TEXT_WAIT_S (then the claim)."""
        word = self.word(OFF_ABORT).value
        if word >> 16 & 0xFFFF == WRITING:
            deadline = time.monotonic() + ABORT_TEXT_WAIT_S
            while word >> 16 & 0xFFFF == WRITING and time.monotonic() < deadline:
                time.sleep(0.001)
                word = self.word(OFF_ABORT).value
        if word:
            atomics().acquire_fence()
        return word

    @property
    def aborted_at(self) -> float | None:
        """When the abort was written (time.monotonic seconds; every process of the
        machine shares the clock), or None while the group is not aborted, or where
        its aborter stopped between its claim and the instant: no time is made up."""
        if not self._abort_word():
            return None
        return self.word(OFF_ABORTED_AT).value / 1e9 or None

    def aborted(self) -> GroupAborted | None:
        """The abort, with its reason, or None while the group is not aborted."""
        word = self._abort_word()
        if not word:
            return None
        code, length, crc = word & 0xFFFF, (word >> 16) & 0xFFFF, word >> 32
        try:
            name = AbortCode(code).name
        except ValueError:
            name = f"code {code}"
        if length == WRITING:
            return GroupAborted(code, f"the group was aborted ({name}); its aborter stopped before it wrote "
                                      "the reason")
        text = ctypes.string_at(self.address + OFF_REASON, min(length, REASON_BYTES))
        if zlib.crc32(text) != crc or length > REASON_BYTES:
            return GroupAborted(code, f"the group was aborted ({name}); its reason was overwritten")
        return GroupAborted(code, f"the group was aborted ({name}): {text.decode(errors='replace')}")

    def check(self) -> None:
        """Raise GroupAborted with the reason once the group is aborted."""
        err = self.aborted()
        if err is not None:
            raise err
