"""Host chunks' pages reserved, zeroed and freed off the daemon's loop, in steps, taking turns by uid.

Why: ``posix_fallocate`` of a memfd costs the kernel about 0.25 s per GiB,
and the last close of a reserved memfd about half that. On the daemon's loop
one user's 16 GiB buffer stalled every other user's setup, agreement and
death notice for seconds; on a plain thread pool it held up every other
user's reservations instead, and a chunk freed while it was still being
reserved went on filling memory nobody was charged for. Zeroing a freed
range of a shared chunk (punching its pages out, then reserving them again)
costs as much per byte: on the loop, a user cycling 64 MiB sets bought 15 ms
of the daemon's time per release.

So the work on a chunk runs in steps of ``STEP_BYTES`` on ``THREADS``
threads: its reservation first, then the ranges freed since (``zero``).
After each step a chunk goes to the back of its uid's queue and the uids
take turns, so another user's small chunk waits for one step of each other
uid at most, however much one user asked for; one chunk never has two steps
running. A chunk freed meanwhile stops at its next step; closes go before
any step (a close is what gives memory back). ``pending`` counts the bytes
still to reserve, which MemAvailable does not show yet. The daemon's loop
is woken through ``wake_fd`` each time a chunk's reservation ends (reserved,
failed or stopped); ``sync`` waits for a chunk's zeroing, which the arena
asks for only when nothing else fits (peerd.arena). A range that could not
be reserved again fails its chunk: ``ready`` raises, and the arena forsakes it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from dataclasses import dataclass, field

from . import AllocationFailed

#: fallocate(2) mode that frees a range's pages, keeping the file's size (allowed on a memfd sealed against
#: resizing)
PUNCH_HOLE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]

#: threads reserving and closing at once
THREADS = 4
#: bytes one step reserves: about 15 ms of a thread's time
STEP_BYTES = 64 << 20


@dataclass(eq=False)
class Reservation:
    """A chunk's memfd, how far its reservation got and the freed ranges it still has to zero; its fields
    change under the Reserver's lock."""

    fd: int
    nbytes: int
    uid: int | None
    reserved: int = 0
    error: AllocationFailed | None = None
    refills: list[list[int]] = field(default_factory=list)  # [offset, bytes left] of freed ranges being zeroed
    queued: bool = False  # in its uid's queue for a step
    stepping: bool = False  # a thread is running a step of it now
    freed: bool = False  # the daemon let the chunk go: its fd is closed once no step uses it

    @property
    def finished(self) -> bool:
        """Its reservation ended: reserved whole, failed, or stopped because the chunk was freed."""
        return self.error is not None or self.freed or self.reserved == self.nbytes

    @property
    def left(self) -> int:
        """Bytes it still has to reserve, its own or freed ranges' (none once failed or freed)."""
        if self.error is not None or self.freed:
            return 0
        return self.nbytes - self.reserved + sum(size for _, size in self.refills)

    def ready(self) -> bool:
        """Reserved whole; AllocationFailed where it could not be."""
        if self.error is not None:
            raise self.error
        return self.reserved == self.nbytes


class Reserver:
    """The threads, the queues (uid -> its chunks waiting for a step, the uids in turn order) and the closes."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._turns: dict[int | None, list[Reservation]] = {}  # in turn order: the next uid first
        self._closes: list[int] = []
        self._pending = 0
        self._stopping = False
        self.wake_fd, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._threads: list[threading.Thread] = []  # started with the first reservation

    @property
    def pending(self) -> int:
        """Bytes of chunks still to reserve: memory promised that MemAvailable does not show as taken yet."""
        return self._pending

    def reserve(self, fd: int, nbytes: int, uid: int | None) -> Reservation:
        reservation = Reservation(fd, nbytes, uid)
        with self._lock:
            self._threads = [thread for thread in self._threads if thread.is_alive()]
            while len(self._threads) < THREADS:
                self._threads.append(threading.Thread(target=self._work, name=f"peerd-host-memory-{len(self._threads)}",
                                                      daemon=True))
                self._threads[-1].start()
            self._pending += nbytes
            self._queue(reservation)
        return reservation

    def zero(self, reservation: Reservation, offset: int, nbytes: int) -> None:
        """Zero a freed range of a reserved chunk: its pages punched out (they read zero), then reserved
        again, so nobody takes a SIGBUS on first touch."""
        with self._lock:
            if reservation.error is not None or reservation.freed:
                return  # never handed out again
            reservation.refills.append([offset, nbytes])
            self._pending += nbytes
            if not (reservation.queued or reservation.stepping):
                self._queue(reservation)

    def sync(self, reservation: Reservation) -> None:
        """Wait until the chunk has no range left to zero (a range that failed fails the chunk: ``ready``)."""
        with self._lock:
            while (reservation.refills or reservation.stepping) and not self._stopping:
                self._lock.wait()

    def free(self, reservation: Reservation) -> None:
        """The chunk is freed: stop its work and close its fd, on a thread (the last close frees the pages)."""
        with self._lock:
            if reservation.freed:
                return  # its fd is closed already, or will be: never twice
            unreserved = not reservation.finished
            self._pending -= reservation.left
            reservation.freed = True
            reservation.refills.clear()
            self._lock.notify_all()  # a sync waiting on it
            if unreserved:
                self._wake()
            if reservation.queued:
                self._unqueue(reservation)
            if reservation.stepping:
                return  # the step's thread closes it (after its step)
            if self._stopping:  # no thread is left to do it
                os.close(reservation.fd)
                return
            self._closes.append(reservation.fd)

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
                    fd, reservation = self._closes.pop(0), None
                elif self._stopping:
                    return
                else:
                    reservation = self._next()
                    reservation.queued, reservation.stepping = False, True
                    refill = reservation.reserved == reservation.nbytes
                    offset, size = reservation.refills[0] if refill else (reservation.reserved, reservation.nbytes)
                    step = min(STEP_BYTES, size if refill else size - offset)
            if reservation is None:
                with contextlib.suppress(OSError):
                    os.close(fd)
                continue
            error = None
            try:
                if refill and _libc.fallocate(reservation.fd, PUNCH_HOLE, offset, step) != 0:
                    raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
                os.posix_fallocate(reservation.fd, offset, step)
            except Exception as err:  # whatever it is, the chunk must finish, and this thread live on
                doing = f"zero {step} bytes of" if refill else f"reserve {reservation.nbytes} bytes of"
                error = AllocationFailed(f"cannot {doing} shared memory: {err}")
            self._stepped(reservation, refill, step, error)

    def _queue(self, reservation: Reservation) -> None:
        """To the back of its uid's queue (under the lock)."""
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

    def _stepped(self, reservation: Reservation, refill: bool, step: int, error: AllocationFailed | None) -> None:
        with self._lock:
            reservation.stepping = False
            left = reservation.left
            if error is not None:
                reservation.error = error  # before any wake-up: a failed chunk never reads as reserved
                reservation.refills.clear()
            elif refill:
                if not reservation.freed:
                    reservation.refills[0][0] += step
                    reservation.refills[0][1] -= step
                    if not reservation.refills[0][1]:
                        reservation.refills.pop(0)
            else:
                reservation.reserved += step
            self._pending += reservation.left - left
            if reservation.freed:
                self._closes.append(reservation.fd)
            elif error is not None or (not refill and reservation.finished):
                self._wake()
            if reservation.left and not reservation.freed:
                self._queue(reservation)  # the back of its uid's queue: every uid's chunks take turns
            else:
                self._lock.notify_all()  # closes to make, a sync waiting on it

    def _wake(self) -> None:
        """Tell the daemon's loop a chunk's reservation ended (under the lock)."""
        with contextlib.suppress(OSError):  # a full pipe is readable already
            os.write(self._wake_w, b"\0")
