"""Host chunks' pages reserved and freed off the daemon's loop, in steps, taking turns by uid.

Why: ``posix_fallocate`` of a memfd costs the kernel about 0.25 s per GiB,
and the last close of a reserved memfd about half that. On the daemon's loop
one user's 16 GiB buffer stalled every other user's setup, agreement and
death notice for seconds; on a plain thread pool it held up every other
user's reservations instead, and a chunk freed while it was still being
reserved went on filling memory nobody was charged for.

So a reservation runs in steps of ``STEP_BYTES`` on ``THREADS`` threads:
after each step a chunk goes to the back of its uid's queue and the uids
take turns, so another user's small chunk waits for one step of each other
uid at most, however much one user asked for. A chunk freed meanwhile stops at its next
step; closes go before any step (a close is what gives memory back).
``pending`` counts the bytes still to reserve, which MemAvailable does not
show yet. The daemon's loop is woken through ``wake_fd`` each time a chunk
is done (reserved, failed or stopped).
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass

from . import AllocationFailed

#: threads reserving and closing at once
THREADS = 4
#: bytes one step reserves: about 15 ms of a thread's time
STEP_BYTES = 64 << 20


@dataclass(eq=False)
class Reservation:
    """A chunk's memfd and how far its reservation got; its fields change under the Reserver's lock."""

    fd: int
    nbytes: int
    uid: int | None
    reserved: int = 0
    error: AllocationFailed | None = None
    finished: bool = False  # reserved whole, failed, or stopped because the chunk was freed
    freed: bool = False  # the daemon let the chunk go: its fd is closed once no step uses it
    stepping: bool = False  # a thread is reserving a step of it now

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
            self._turns.setdefault(uid, []).append(reservation)
            self._lock.notify()
        return reservation

    def free(self, reservation: Reservation) -> None:
        """The chunk is freed: stop reserving it and close its fd, on a thread (the last close frees the pages)."""
        with self._lock:
            if reservation.freed:
                return  # its fd is closed already, or will be: never twice
            reservation.freed = True
            if reservation.stepping:
                return  # the step's thread closes it (after its step, stopping or not)
            if self._stopping:  # no thread is left to do it
                os.close(reservation.fd)
                return
            if not reservation.finished:
                self._turns[reservation.uid].remove(reservation)
                if not self._turns[reservation.uid]:
                    del self._turns[reservation.uid]
                self._finish(reservation)
            self._closes.append(reservation.fd)
            self._lock.notify()

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
                    reservation.stepping = True
            if reservation is None:
                with contextlib.suppress(OSError):
                    os.close(fd)
                continue
            step = min(STEP_BYTES, reservation.nbytes - reservation.reserved)
            error = None
            try:
                os.posix_fallocate(reservation.fd, reservation.reserved, step)
            except Exception as err:  # whatever it is, the chunk must finish, and this thread live on
                error = AllocationFailed(f"cannot reserve {reservation.nbytes} bytes of shared memory: {err}")
            self._stepped(reservation, step, error)

    def _next(self) -> Reservation:
        """The first chunk of the uid whose turn it is; that uid goes to the back of the turns."""
        uid = next(iter(self._turns))
        waiting = self._turns.pop(uid)
        reservation = waiting.pop(0)
        if waiting:
            self._turns[uid] = waiting
        return reservation

    def _stepped(self, reservation: Reservation, step: int, error: AllocationFailed | None) -> None:
        with self._lock:
            reservation.stepping = False
            if error is None:
                reservation.reserved += step
                self._pending -= step
            reservation.error = error  # before any wake-up: a failed chunk never reads as reserved
            if reservation.freed:
                self._finish(reservation)
                self._closes.append(reservation.fd)
                self._lock.notify()
            elif error is not None or reservation.reserved == reservation.nbytes:
                self._finish(reservation)
            else:  # the back of its uid's queue: every uid's chunks take turns
                self._turns.setdefault(reservation.uid, []).append(reservation)
                self._lock.notify()

    def _finish(self, reservation: Reservation) -> None:
        """Done, one way or another (under the lock): what it will not reserve is no longer pending."""
        self._pending -= reservation.nbytes - reservation.reserved
        reservation.finished = True
        with contextlib.suppress(OSError):  # a full pipe is readable already
            os.write(self._wake_w, b"\0")
