"""Host chunks' pages reserved, zeroed and freed off the daemon's loop, in steps, taking turns by uid.

Why: ``posix_fallocate`` of a memfd costs the kernel about 0.25 s per GiB,
and giving a reserved memfd's pages back about half that. On the daemon's loop
one user's 16 GiB buffer stalled every other user's setup, agreement and
death notice for seconds; on a plain thread pool it held up every other
user's reservations instead, and a chunk freed while it was still being
reserved went on filling memory nobody was charged for. Zeroing a freed
range of a shared chunk (punching its pages out, then reserving them again)
costs as much per byte: on the loop, a user cycling 64 MiB sets bought 15 ms
of the daemon's time per release.

So the work on a chunk runs in steps of ``STEP_BYTES`` on ``THREADS``
threads: its reservation first, then the ranges freed since (``zero``),
lowest first. After each step a chunk goes to the back of its uid's queue
and the uids take turns, so another user's small chunk waits for one step
of each other uid at most, however much one user asked for (a step zeroes
``STEP_RANGES`` freed ranges at most); one chunk never has two steps running. A chunk freed meanwhile stops at its next step;
closes go before any step (a close is what gives memory back), and each
close is reported (``closed``: the daemon's fd room gets its place back).
``pending`` counts the bytes still to reserve, which MemAvailable does not
show yet: a chunk's rest, and the ranges a step has punched out and not yet
reserved again; ``closing`` the bytes of freed chunks whose close has not
ended, which MemAvailable does not show as free yet. A close punches the pages out first, so a member
that kept the chunk's fd keeps none of them. A chunk may be admitted
on the memory a close is about to give back (``on_credit``: a set's first
try after empty chunks went back for it), so each step of such a chunk
checks the memory first (``room``, counting every chunk admitted before it)
and, where it is short while closes are under way, waits for them instead of
failing; where it is still short once they ended (the memory went to
others meanwhile), it fails with the numbers. Other chunks never wait
on it: they were admitted on memory that was there.

The daemon's loop is woken through ``wake_fd`` each time a
chunk's reservation ends (reserved, failed or stopped) and after each
step of zeroing (a range done, or failed); ``woken`` names those chunks, so the loop asks
only the sets waiting on them, and ``ready`` says, for a range, whether it may be handed
out: nothing on the loop ever waits for these threads. Ranges that could
not be reserved again fail the set that asks for one of them (the memory
was short), and are zeroed once more from then on, so the next set handed
one waits for that try instead of failing at once.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator

from ..punch import punch_out
from . import AllocationFailed

#: threads reserving and closing at once
THREADS = 4
#: bytes one step reserves: about 15 ms of a thread's time
STEP_BYTES = 64 << 20
#: freed ranges one step zeroes at most (two syscalls each): thousands of 4 KiB ones cost more than their bytes
STEP_RANGES = 512


class Ranges:
    """Disjoint byte ranges [start, end), sorted, touching ones merged; ``total`` bytes in all. Each
    operation is a binary search plus the ranges it touches, so a chunk with thousands freed stays cheap."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        self.total = 0

    def add(self, start: int, end: int) -> None:
        if start >= end:
            return
        self.remove(start, end)
        self.total += end - start
        at = bisect.bisect_left(self._starts, start)
        if at < len(self._starts) and self._starts[at] == end:  # the next one touches it
            end = self._ends.pop(at)
            del self._starts[at]
        if at > 0 and self._ends[at - 1] == start:  # so does the previous one
            self._ends[at - 1] = end
        else:
            self._starts.insert(at, start)
            self._ends.insert(at, end)

    def remove(self, start: int, end: int) -> None:
        self.remove_all([(start, end - start)])

    def remove_all(self, pieces: list[tuple[int, int]]) -> None:
        """Take out (offset, bytes) pieces, sorted and disjoint, in one pass over the ranges they touch."""
        pieces = [(offset, offset + size) for offset, size in pieces if size > 0]
        if not pieces:
            return
        lo = bisect.bisect_right(self._ends, pieces[0][0])  # the first range ending past the first piece
        hi = bisect.bisect_left(self._starts, pieces[-1][1])  # the ranges starting before the last one ends
        kept_starts, kept_ends, at = [], [], 0
        for start, end in zip(self._starts[lo:hi], self._ends[lo:hi]):
            while at < len(pieces) and pieces[at][1] <= start:
                at += 1
            cut = at
            while cut < len(pieces) and pieces[cut][0] < end:  # the pieces overlapping [start, end)
                self.total -= min(end, pieces[cut][1]) - max(start, pieces[cut][0])
                if pieces[cut][0] > start:
                    kept_starts.append(start)
                    kept_ends.append(pieces[cut][0])
                start = max(start, pieces[cut][1])
                if pieces[cut][1] > end:
                    break
                cut += 1
            at = cut
            if start < end:
                kept_starts.append(start)
                kept_ends.append(end)
        self._starts[lo:hi], self._ends[lo:hi] = kept_starts, kept_ends

    def overlaps(self, start: int, end: int) -> bool:
        at = bisect.bisect_right(self._ends, start)
        return at < len(self._starts) and self._starts[at] < end

    def front(self, limit: int, count: int) -> list[tuple[int, int]]:
        """(offset, bytes) pieces from the lowest: ``count`` at most, ``limit`` bytes in all at most."""
        pieces = []
        for start, end in zip(self._starts[:count], self._ends[:count]):
            size = min(end - start, limit)
            pieces.append((start, size))
            limit -= size
            if not limit:
                break
        return pieces

    def __iter__(self) -> Iterator[tuple[int, int]]:
        """Each range as (start, end), lowest first."""
        return zip(self._starts, self._ends)

    def clear(self) -> None:
        self._starts.clear()
        self._ends.clear()
        self.total = 0


@dataclass(eq=False)
class Reservation:
    """A chunk's memfd, how far its reservation got, and its freed ranges; changed under the Reserver's lock."""

    fd: int
    nbytes: int
    uid: int | None
    handle: bytes  # the chunk's, as ``woken`` names it to the loop
    reserved: int = 0
    error: AllocationFailed | None = None  # the reservation failed: the whole chunk is lost
    zeroing: Ranges = field(default_factory=Ranges)  # freed ranges still to punch out and reserve again
    unzeroed: Ranges = field(default_factory=Ranges)  # ranges whose pages could not be had again
    unzeroed_error: AllocationFailed | None = None  # why, the last time
    queued: bool = False  # in its uid's queue for a step
    stepping: bool = False  # a thread is running a step of it now
    on_credit: bool = False  # admitted on memory chunks being closed give back: each step checks the room
    parked: bool = False  # its step waits for the closes under way to end
    freed: bool = False  # the daemon let the chunk go: its fd is closed once no step uses it
    closed: bool = False  # its fd is closed, or being closed: never twice

    @property
    def finished(self) -> bool:
        """Its reservation ended: reserved whole, failed, or stopped because the chunk was freed."""
        return self.error is not None or self.freed or self.reserved == self.nbytes

    @property
    def has_work(self) -> bool:
        return self.error is None and not self.freed and (self.reserved < self.nbytes or self.zeroing.total > 0)


class Reserver:
    """The threads, the queues (uid -> its chunks waiting for a step, the uids in turn order) and the closes."""

    def __init__(self, closed: Callable[[], None] = lambda: None, room: Callable[[int], None] = lambda nbytes: None) -> None:
        self._lock = threading.Condition()
        self._room = room  # raises AllocationFailed where reserving that many bytes now would leave memory short
        self._turns: dict[int | None, list[Reservation]] = {}  # in turn order: the next uid first
        self._closes: list[Reservation] = []
        self._closed = closed
        self._pending = 0
        self._closing = 0
        self._closes_done = 0  # closes ended so far: a room check that raced one tries again
        self._parked: list[Reservation] = []  # chunks whose step waits for the closes under way to end
        self._stopping = False
        self._keep_pages = False  # shutdown: freed memory stays as it is for whoever still maps it
        self.wake_fd, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._woken: list[Reservation] = []  # chunks whose work ended since the loop last asked
        self._threads: list[threading.Thread] = []  # started with the first reservation

    @property
    def pending(self) -> int:
        """Bytes still to reserve: memory promised that MemAvailable does not show as taken yet."""
        return self._pending

    @property
    def closing(self) -> int:
        """Bytes of freed chunks whose close has not ended: memory MemAvailable does not show as free yet."""
        return self._closing

    def reserve(self, fd: int, nbytes: int, uid: int | None, handle: bytes, on_credit: bool = False) -> Reservation:
        reservation = Reservation(fd, nbytes, uid, handle, on_credit=on_credit)
        with self._lock:
            self._threads = [thread for thread in self._threads if thread.is_alive()]
            while len(self._threads) < THREADS:
                thread = threading.Thread(target=self._work, name=f"peerd-host-memory-{len(self._threads)}", daemon=True)
                thread.start()  # one that could not start is not kept: close() would wait on it
                self._threads.append(thread)
            self._pending += nbytes
            self._queue(reservation)
        return reservation

    def ready(self, reservation: Reservation, span: tuple[int, int] | None = None) -> bool:
        """Reserved whole, and (for ``span``: offset, bytes) no zeroing of it left; AllocationFailed where
        the chunk, or that range, could not be had."""
        with self._lock:
            if reservation.error is not None:
                raise reservation.error
            if reservation.reserved < reservation.nbytes:
                return False
            if span is None:
                return True
            start, end = span[0], span[0] + span[1]
            if reservation.unzeroed.overlaps(start, end):
                self._retry(reservation)  # memory may be back: the next set handed these ranges waits for it
                raise reservation.unzeroed_error
            return not reservation.zeroing.overlaps(start, end)

    def zero(self, reservation: Reservation, offset: int, nbytes: int) -> None:
        """Zero a freed range: its pages punched out (they read zero), then reserved again, so nobody takes
        a SIGBUS on first touch. Until then ``ready`` says no for it."""
        with self._lock:
            if reservation.error is not None or reservation.freed:
                return  # never handed out again
            reservation.unzeroed.remove(offset, offset + nbytes)  # a range that failed is tried again
            reservation.zeroing.add(offset, offset + nbytes)
            self._queue(reservation)

    def free(self, reservation: Reservation) -> None:
        """The chunk is freed: stop its work and close its fd, on a thread (the last close frees the pages)."""
        with self._lock:
            if reservation.freed:
                return  # its fd is closed already, or will be: never twice
            if reservation.error is None:
                self._pending -= reservation.nbytes - reservation.reserved
            reservation.freed = True
            reservation.zeroing.clear()
            if reservation.queued:
                self._unqueue(reservation)
            if reservation.parked:
                reservation.parked = False
                self._parked.remove(reservation)
            self._closing += reservation.reserved
            if reservation.stepping:
                return  # the step's thread closes it (after its step)
            if not self._stopping:
                self._close_later(reservation)
                return
        self._close(reservation)  # no thread is left to do it

    def keep_pages(self) -> None:
        """Shutdown begins: no chunk closed from now on is punched out (the arena zeroes no range either:
        peerd.arena). Live workers still map their buffers (the kernel frees the pages with their last
        holder), and may still read them."""
        with self._lock:
            self._keep_pages = True

    def close(self) -> None:
        """Stop: the steps under way end, the closes asked for are made, no further step is taken."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        for thread in self._threads:
            thread.join()
        for fd in (self.wake_fd, self._wake_w):
            os.close(fd)

    def _work(self) -> None:
        while True:
            with self._lock:
                while not (self._stopping or self._closes or self._turns):
                    self._lock.wait()
                if self._closes:
                    closing, reservation = self._closes.pop(0), None
                elif self._stopping:
                    return
                else:
                    reservation = self._next()
                    reservation.queued, reservation.stepping = False, True
                    refill = reservation.reserved == reservation.nbytes
                    if refill:
                        pieces = reservation.zeroing.front(STEP_BYTES, STEP_RANGES)
                        self._pending += sum(size for _, size in pieces)  # punched out: no longer in use
                    else:
                        pieces = [(reservation.reserved, min(STEP_BYTES, reservation.nbytes - reservation.reserved))]
            if reservation is None:
                self._close(closing)
                continue
            done, error = 0, None
            try:
                if refill:  # punched out first (they read zero), then reserved again where memory allows
                    for offset, size in pieces:
                        punch_out(reservation.fd, offset, size)
                    self._room(sum(size for _, size in pieces))
                elif reservation.on_credit and self._room_short(reservation, pieces[0][1]):
                    continue
                for offset, size in pieces:
                    os.posix_fallocate(reservation.fd, offset, size)
                    done += 1
            except Exception as err:  # whatever it is, the step must end, and this thread live on
                doing = "zero a freed range" if refill else f"reserve {reservation.nbytes} bytes"
                again = "; the range is zeroed again for the next set handed it" if refill else ""
                error = AllocationFailed(f"cannot {doing} of shared memory: {err}{again}")
            with self._lock:
                self._stepped(reservation, refill, pieces, done, error)

    def _room_short(self, reservation: Reservation, nbytes: int) -> bool:
        """Before a step of a chunk admitted on credit: True where memory is short while closes are under
        way (the chunk then waits for them, parked) or one ended during the check (it tries again);
        AllocationFailed where it is short with none to wait for."""
        closes_done = self._closes_done
        try:
            self._room(nbytes)
            return False
        except AllocationFailed:
            with self._lock:
                if not self._closing and self._closes_done == closes_done:
                    raise
                reservation.stepping = False
                if reservation.freed:
                    self._close_later(reservation)
                elif self._closing:  # a zero() meanwhile queues nothing: its ranges wait with the chunk (_queue)
                    reservation.parked = True
                    self._parked.append(reservation)
                else:
                    self._queue(reservation)
            return True

    def _close_later(self, reservation: Reservation) -> None:
        """A thread closes the freed chunk's memfd, before any step (under the lock)."""
        self._closes.append(reservation)
        self._lock.notify()

    def _close(self, reservation: Reservation) -> None:
        """Punch a freed chunk's pages out and close its memfd, once (a second close could hit whatever
        reused the number), then let the chunks parked for memory try again. Why punch: a member may keep
        the fd it was handed, and the last close alone would leave the pages, charged to the daemon, to
        that process, past every cap; punched, they are back at once, and a page the member touches again
        is its own (reading zero)."""
        with self._lock:
            if reservation.closed:
                return
            reservation.closed = True
        if not self._keep_pages:
            with contextlib.suppress(OSError):  # a bad fd: the close fails alike
                punch_out(reservation.fd, 0, reservation.nbytes)
        with contextlib.suppress(OSError):
            os.close(reservation.fd)
        with self._lock:
            self._closing -= reservation.reserved
            self._closes_done += 1
            parked, self._parked = self._parked, []
            for waiting in parked:
                waiting.parked = False
                self._queue(waiting)
        self._closed()

    def _stepped(self, reservation: Reservation, refill: bool, pieces: list[tuple[int, int]], done: int,
                 error: AllocationFailed | None) -> None:
        """Account for a step (under the lock): the first ``done`` pieces went well, the next raised ``error``."""
        reservation.stepping = False
        if refill:
            self._pending -= sum(size for _, size in pieces)
            if not reservation.freed:  # no one was handed these ranges while they were zeroed: none rejoined
                reservation.zeroing.remove_all(pieces)
                if error is not None:  # the rest of the step's pieces are as unsure: all of them wait for a retry
                    for offset, size in pieces[done:]:
                        reservation.unzeroed.add(offset, offset + size)
                    reservation.unzeroed_error = error
                self._wake(reservation)  # after each step: a set waiting for one of its ranges may open, and
                # the loop asks only the sets waiting on this chunk
        elif not reservation.freed:
            if error is None:
                reservation.reserved += pieces[0][1]
                self._pending -= pieces[0][1]
            else:
                reservation.error = error  # before any wake-up: a failed chunk never reads as reserved
                self._pending -= reservation.nbytes - reservation.reserved
            if reservation.finished:
                self._wake(reservation)
        if reservation.freed:
            self._close_later(reservation)
        elif reservation.has_work:
            self._queue(reservation)  # the back of its uid's queue: every uid's chunks take turns

    def _retry(self, reservation: Reservation) -> None:
        """Zero every range that failed once more (under the lock)."""
        for start, end in reservation.unzeroed:
            reservation.zeroing.add(start, end)
        reservation.unzeroed.clear()
        self._queue(reservation)

    def _queue(self, reservation: Reservation) -> None:
        """To the back of its uid's queue, unless it is there, stepping or parked already, or freed
        (under the lock)."""
        if reservation.queued or reservation.stepping or reservation.parked or reservation.freed:
            return
        reservation.queued = True
        self._turns.setdefault(reservation.uid, []).append(reservation)
        self._lock.notify()

    def _unqueue(self, reservation: Reservation) -> None:
        reservation.queued = False
        self._turns[reservation.uid].remove(reservation)
        if not self._turns[reservation.uid]:
            del self._turns[reservation.uid]

    def _next(self) -> Reservation:
        """The first chunk of the uid whose turn it is; that uid goes to the back of the turns."""
        uid = next(iter(self._turns))
        waiting = self._turns.pop(uid)
        reservation = waiting.pop(0)
        if waiting:
            self._turns[uid] = waiting
        return reservation

    def _wake(self, reservation: Reservation) -> None:
        """Tell the daemon's loop this chunk's memory may be ready now (under the lock): one byte until it
        asks which (``woken``), however many chunks end meanwhile."""
        self._woken.append(reservation)
        if len(self._woken) == 1:
            with contextlib.suppress(OSError):  # a full pipe is readable already
                os.write(self._wake_w, b"\0")

    def woken(self) -> list[Reservation]:
        """The chunks whose reservation or zeroing ended (or failed) since the last call; ``wake_fd`` drained
        first, so a chunk that ends meanwhile wakes the loop again."""
        with contextlib.suppress(BlockingIOError):
            os.read(self.wake_fd, 4096)
        with self._lock:
            woken, self._woken = self._woken, []
        return woken
