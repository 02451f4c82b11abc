"""PeerBuffer: the seeds' symmetric peer memory, brokered by the peerd daemon."""

from __future__ import annotations

import logging
import os
import threading
import weakref

from peerd.backends import mapper as backend_mapper
from peerd.fdchannel import fetch_fds
from peerd.paths import fd_socket_path
from peerd.protocol import MAX_REASON_CHARS, ProtocolError

from .connection import GRACE_S, REQUEST_TIMEOUT_S, Connection, checked_fields, checked_timeout, connection
from .errors import BACKEND_UNAVAILABLE, DaemonUnavailable, ForkedProcessError, MonoUnsupported
from .groupkey import Contradicted, Membership, integral, remember, resolve
from .mappings import ChunkKey, mappings
from .pagelink import GroupLink, close_link, link_for, open_link
from .stoppedpeers import own_pid, stopped_peers
from .teardown import Teardown, finish_waiting
from .views import backend_for, byte_view, require_torch, worker_device

log = logging.getLogger("peerd_client")

DEFAULT_NAME = "default"


def _unusable_timeout(timeout) -> MonoUnsupported | None:
    """The BAD_REQUEST of a ``timeout=`` no wait can honour, or None."""
    try:
        checked_timeout("PeerBuffer", timeout)
    except MonoUnsupported as err:
        return err
    return None


def _member_fds(conn: Connection, slot: dict, handles: list[bytes]) -> list[int]:
    """This rank's set as fds from the daemon's fd channel, in the order of ``handles``."""
    path = fd_socket_path(conn.path)
    try:
        sent, fds = fetch_fds(path, slot, REQUEST_TIMEOUT_S, daemon_pid=conn.hello["pid"], daemon_uid=conn.daemon_uid)
    except ProtocolError as err:
        raise MonoUnsupported(f"the daemon gave this rank no memory: {err.message}", err.code.value) from None
    except OSError as err:
        raise DaemonUnavailable(f"cannot fetch this rank's memory from the daemon's fd channel {path}: {err}") from None
    if sent != handles:
        for fd in set(fds):
            os.close(fd)
        raise MonoUnsupported(f"the daemon's fd channel {path} sent the memory of another set than the join named",
                              "BAD_REQUEST")
    return fds


class PeerBuffer:
    """One buffer per rank, every rank holding every peer's address
    (``addresses``, int64, indexed by rank).

    The daemon owns the memory: it allocates each rank's buffer, hands every
    rank every handle once all ranks joined, and frees the set only once no
    rank holds it, so no rank's exit frees memory under a peer's kernel. The
    constructor is collective over ``group`` (join, open every handle, then
    an agreement that every rank mapped every peer): a failure on any rank
    raises ``MonoUnsupported`` on all of them, with the cause.

    ``PeerBuffer(nbytes, group, rank, npes, device)`` takes a string key;
    ``PeerBuffer(nbytes, process_group)`` takes rank and npes from a torch
    ProcessGroup; a ``group`` of None is a single rank (TP=1), as in the
    seeds. ``name`` tells apart several buffer sets of one group.
    """

    def __init__(
        self,
        nbytes: int,
        group,
        rank: int | None = None,
        npes: int | None = None,
        device=None,
        *,
        name: str = DEFAULT_NAME,
        flags: int = 0,
        timeout: float | None = None,
    ):
        nbytes = integral(nbytes)
        unusable = _unusable_timeout(timeout)  # told to the peers (_take_part), else raised before any other error
        try:
            require_torch()  # before any call to the daemon: without torch, nothing is asked of it
            finish_waiting()  # buffers closed inside a CUDA graph capture: released now (peerd_client.teardown)
            self._pid = os.getpid()
            self._taking = threading.Lock()  # what a close takes to give back, taken once
            self._handles: list[bytes] = []
            self._chunks: list[ChunkKey] = []
            self._link: GroupLink | None = None
            self._addresses_copied = None  # a torch.cuda.Event: the address copy, until it is seen complete
            self._released = True
            try:
                self._conn = conn = connection(starting_over=True)  # its deadlines come from a daemon that runs
            except DaemonUnavailable:
                _check_size(nbytes)  # a programming error outranks a missing daemon, whose fallback would hide it
                raise
            # the deadlines are decided here and sent: the daemon waits exactly as long, so it answers first
            timeout = None if unusable else timeout
            rendezvous = timeout or conn.hello["rendezvous_timeout"]
            agreement = timeout or conn.hello["agreement_timeout"]
            wait = rendezvous + GRACE_S
            member = resolve(group, rank, npes, rendezvous)
        except Contradicted as err:  # this rank's place is known all the same: its peers are told there,
            if isinstance(group, str) and link_for(group) is None:  # unless it is a string key's place this
                raise (unusable or ValueError(str(err))) from None  # process held once (another's now, maybe)
            member, unusable = err.member, unusable or err
        except Exception:
            if unusable is not None:
                raise unusable from None
            raise
        self.rank, self.npes, self.nbytes, self.name = member.rank, member.npes, nbytes, name
        self.group_key = member.key
        where = f"group={member.key} name={name} rank {member.rank}"
        device_identity = self._take_part(conn, member, nbytes, flags, device, where, unusable)

        try:
            joined = conn.call(
                "join",
                {
                    **self._slot(member),
                    "npes": member.npes,
                    "nbytes": nbytes,
                    "device": device_identity,
                    "flags": flags,
                    "timeout": rendezvous,
                    **({"own_pid": claim} if (claim := own_pid()) else {}),
                },
                timeout=wait,
            )
        except DaemonUnavailable as err:
            conn.send_later("release", self._slot(member))  # whatever the daemon still holds for this rank
            raise type(err)(f"peer memory rendezvous failed ({where}): {err}", err.code) from None
        except MonoUnsupported as err:
            raise type(err)(f"peer memory rendezvous failed ({where}): {err}", err.code) from None
        except BaseException:  # interrupted while waiting (Ctrl-C): whatever the daemon holds for this rank goes
            conn.send_later("release", self._slot(member))
            raise
        self._released = False
        self._set = joined["set"]  # what the release names: see the release op
        try:
            self._set_up(conn, member, joined, agreement, where)
        except BaseException:  # interrupted (Ctrl-C) or failed: no rank of this process may keep holding the set,
            self._close(wait=False)  # which its peers would wait out, and which this process could not join again
            raise

    def _set_up(self, conn: Connection, member: Membership, joined: dict, agreement: float, where: str) -> None:
        """Map every rank's buffer, then the commit vote: on the control page, else through the daemon."""
        torch = require_torch()
        remember(member)

        failure, pointers, fds = None, [], []
        self._link = GroupLink(conn.hello.get("instance"), member.rank, member.npes, where,
                               conn.hello["agreement_timeout"], joined["set"])
        try:
            _check_joined(joined, conn.hello["backend"], member.npes)
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # handles open in the current device's context
            chunks = [(conn.run, handle) for handle in joined["handles"]]
            claimed = self._mapper.passes_fds and mappings.claim(chunks)  # Note [Given-back host chunks]
            if claimed:
                self._chunks = chunks  # the uses claimed, which close() gives back whatever comes next
                pointers = [mappings.address(key) + offset for key, offset in zip(chunks, joined["offsets"])]
            elif self._mapper.passes_fds:
                fds = _member_fds(conn, self._held(), joined["handles"])
            # answered while the chunks open; after the fds above, so a rank leaves one reply unread at a time
            self._link.ask(conn, self._held(), joined.get("page"))
            if not claimed:
                for n, (key, offset, span) in enumerate(zip(chunks, joined["offsets"], joined["chunk_sizes"])):
                    whole = offset == 0 and joined["sizes"][n] == span
                    pointers.append(mappings.open(self._mapper, key, span, fds[n] if fds else None, whole) + offset)
                    self._chunks.append(key)
            self._handles = joined["handles"]
        except Exception as err:  # every rank must still reach the agreement
            failure = err
            log.warning("%s could not map a peer: %s", where, err)
        finally:
            for fd in set(fds):  # a mapping keeps the memory; the fds are spent (ranks of one chunk share one)
                os.close(fd)
        if failure is None:  # every rank takes the page or none: GroupLink.choose after the verdict
            self._link.attach(conn, self._held(), self.device, joined.get("page"))
            # from the commit vote on: a peer stopped before its vote aborts the page past the grace
            stopped_peers.watch(self._link, joined.get("pids"), joined.get("own_pids"))
        else:
            self._link.close()  # the page area's request, if one went out, is not read
        try:
            if failure is None and self._link.page is not None:
                verdict = self._commit_on_page(conn, member, pointers, agreement)
            else:
                reason = "" if failure is None else f"{type(failure).__name__}: {failure}"[:MAX_REASON_CHARS]
                verdict = conn.call(
                    "commit",
                    {**self._held(), "ok": failure is None, "reason": reason, "timeout": agreement},
                    timeout=agreement + GRACE_S,
                    meanwhile=None if failure else lambda: self._view(pointers),  # while the others vote
                )
        except MonoUnsupported as err:
            self.close()
            raise type(err)(f"peer memory agreement failed ({where}): {err}", err.code) from None
        if failure is not None or not verdict["ok"]:  # a yes forged on the page hides no failure of this rank's
            self.close()
            side = "this" if failure else "another"
            reason = verdict["reason"] if not verdict["ok"] else f"{type(failure).__name__}: {failure}"
            raise MonoUnsupported(
                f"peer memory handshake failed on {side} rank ({where}): {reason}", "GROUP_FAILED"
            ) from failure

        self._link.choose()
        open_link(member.key, self._link, joined.get("supersedes") or [])

    def _commit_on_page(self, conn: Connection, member: Membership, pointers: list[int], timeout: float) -> dict:
        """The commit vote of a rank that holds the set's control page: its views first, then the vote
        on the page (its round 1), where every rank's vote lands, written by the rank itself or, for a
        rank without the page, by the daemon on its message. No rank waits for the daemon, nor tells
        it a yes: the daemon reads the round off the page (peerd.rendezvous: COMMIT_LOOK_FIRST_S). A
        round that failed here (it timed out, or a peer voted no) is posted as a no with the reason,
        and the daemon fails the set, aborting the page with the reason, as where a rank died or left."""
        self._view(pointers)
        verdict = self._link.commit(timeout)
        if not verdict["ok"] and not verdict["aborted"]:  # this rank's release follows it
            conn.post("commit", {**self._held(), "ok": False, "timeout": timeout, "page": True,
                                 "reason": verdict["reason"][:MAX_REASON_CHARS]})
        return verdict

    def _view(self, pointers: list[int]) -> None:
        """The views of the mapped set: made before the vote on the page, or while the daemon collects
        the votes; dropped if the commit fails."""
        self._pointers = pointers
        self._local = pointers[self.rank]
        torch = require_torch()
        # queued on the device's current stream, not waited for: with several processes on one GPU a
        # blocking copy waits for this context's time slice (about 0.8 ms of an 8-rank setup on an H200)
        self._addresses = torch.tensor(pointers, dtype=torch.int64).to(self.device, non_blocking=True)
        if self.device.type == "cuda":
            self._addresses_copied = torch.cuda.Event()
            self._addresses_copied.record(torch.cuda.current_stream(self.device))

    def _take_part(self, conn, member: Membership, nbytes: int, flags: int, device, where: str,
                   unusable: Exception | None) -> str:
        """This rank's device identity, or withdraw from the rendezvous and raise.

        A rank whose size, flags, timeout, device or backend is unusable here,
        or whose rank=/npes= contradict the place it holds, tells the daemon, so
        its peers fail at once with the reason instead of waiting out the
        rendezvous; it raises MonoUnsupported (BACKEND_UNAVAILABLE, or the
        BAD_REQUEST of a field the protocol refuses), or the ValueError of a
        size, device or place peerd does not serve.
        """
        try:
            if unusable is not None:
                raise unusable
            _check_size(nbytes)
            checked_fields("PeerBuffer", "join", {"npes": member.npes, "nbytes": nbytes, "flags": flags})
            self.device = worker_device(device)
            self._mapper = backend_mapper(backend_for(self.device, conn.hello["backend"]))
            return self._mapper.device_identity(self.device.index)
        except Exception as err:
            reason = f"{type(err).__name__}: {err}"
            try:
                if member.npes != 1:  # a single rank has nobody to tell
                    conn.call("withdraw", {**self._slot(member), "npes": member.npes,
                                           "reason": reason[:MAX_REASON_CHARS]})
            except MonoUnsupported as refused:
                log.warning("%s: the daemon did not take the withdrawal: %s", where, refused)
            if isinstance(err, (ValueError, TypeError, MonoUnsupported)):
                raise
            raise MonoUnsupported(f"this rank cannot take part ({where}): {reason}", BACKEND_UNAVAILABLE) from err

    def _slot(self, member: Membership) -> dict:
        return {"group": member.key, "name": self.name, "rank": member.rank}

    def _held(self) -> dict:
        """The slot, and the set this rank joined: the daemon answers for that set alone, never for
        another set of the key this process may still hold."""
        return {"group": self.group_key, "name": self.name, "rank": self.rank, "set": self._set}

    def _guard(self) -> None:
        if os.getpid() != self._pid:
            raise ForkedProcessError(
                f"this PeerBuffer was made by pid {self._pid}; pid {os.getpid()} is a forked child "
                "and shares none of its mappings: create buffers in the child itself "
                "(or start workers with the 'spawn' method)"
            )

    @property
    def local(self) -> int:
        """This rank's buffer address in this process (0 once closed)."""
        self._guard()
        return getattr(self, "_local", 0)

    @property
    def bytes(self):
        """A torch uint8 view of this rank's buffer (None once closed). The view keeps this PeerBuffer,
        and so the mapping under it, alive, as a torch tensor keeps its storage: a view that outlived
        a collected buffer read unmapped memory (close() still unmaps under it, as documented). The
        buffer holds the view weakly, so the two never keep each other alive."""
        self._guard()
        local = getattr(self, "_local", 0)  # once: another thread's close() may clear it meanwhile
        if not local:
            return None
        known = getattr(self, "_bytes", None)
        view = known() if known is not None else None
        if view is None:
            view = byte_view(local, self.nbytes, self.device, owner=self)
            self._bytes = weakref.ref(view)
        return view

    @property
    def addresses(self):
        """int64 tensor on ``device`` of every rank's buffer address, by rank.

        Filled by a copy queued at construction on the stream then current: until the copy is seen
        complete, the stream current at each access waits for it on the device (the host never
        blocks), so read it again on any other stream it is used on before then. Inside a CUDA
        graph capture nothing waits: a capture starts with a device synchronize.
        """
        self._guard()
        copied = self._addresses_copied
        if copied is not None:
            torch = require_torch()
            if torch.cuda.is_current_stream_capturing() or copied.query():  # no event call inside a capture
                self._addresses_copied = None
            else:
                torch.cuda.current_stream(self.device).wait_event(copied)
        return getattr(self, "_addresses", None)

    @property
    def abort_source(self):
        """What kernels of this buffer poll for its group's abort (all_reduce's default ``abort``):
        the control page mapped for the GPU (host backend: the page), or None without a page."""
        self._guard()
        return self._link.abort_source if self._link is not None else None

    @property
    def abort_address(self) -> int:
        """Where a kernel on this buffer's device loads the group's abort word (an int64:
        non-zero once the group is aborted); 0 where the group has no control page."""
        source = self.abort_source
        return source.abort_address if source is not None else 0

    def check(self) -> None:
        """Raise MonoUnsupported with the reason once the group is aborted (a member died,
        left or was evicted, a set of the group failed, the daemon stopped)."""
        self._guard()
        page = self._link.page if self._link is not None else None
        aborted = page.aborted() if page is not None else None
        if aborted is not None:
            raise MonoUnsupported(f"group={self.group_key} name={self.name}: {aborted.reason}", "GROUP_FAILED")

    @property
    def pointers(self) -> list[int]:
        """``addresses`` as a list of ints."""
        self._guard()
        return list(getattr(self, "_pointers", []))

    def close(self) -> None:
        """Unmap every peer, then release this rank's hold; idempotent.

        The daemon frees the memory once every rank has released (or died), so
        closing never pulls memory from under a peer. Never raises: a release
        the daemon does not answer now (it stalled) is sent again once it
        does; a daemon that restarted has freed everything already. Where
        another thread of this process is inside a call to the daemon (a
        rendezvous may wait a minute), that thread sends the release at once
        and close() does not wait behind it.
        """
        if os.getpid() == self._pid:
            finish_waiting()
        self._close(wait=True)

    def _close(self, wait: bool, collected: bool = False) -> None:
        if os.getpid() != self._pid:
            return  # a forked child holds nothing of its parent's
        self._bytes = self._addresses = self._addresses_copied = None
        self._local, self._pointers = 0, []
        with self._taking:  # two threads closing it at once: one of them gives back its chunks' uses
            chunks, self._chunks, self._handles = self._chunks, [], []
            link, self._link = self._link, None
            released, self._released = self._released, True  # what is still owed is the teardown's: done once
        if link is not None:
            try:
                close_link(self.group_key, link)
            except Exception as err:
                log.warning("closing the control page of group=%s failed: %s", self.group_key, err)
        if released and not chunks:
            return  # nothing held, nothing mapped (a construction that failed early, or a second close)
        slot = None if released else self._held()
        label = f"group={self.group_key} name={self.name} rank {self.rank}"
        Teardown(self.device, chunks, self._conn, slot, label).run(wait, collected)

    def __enter__(self) -> "PeerBuffer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self._close(wait=False, collected=True)  # never block, nor synchronize a GPU, inside a collection
        except Exception:  # interpreter shutdown: nothing left to report to
            pass


def _check_size(nbytes) -> None:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")


def _check_joined(joined: dict, backend: str, npes: int) -> None:
    """A join reply made by the backend hello named, with one buffer per rank: else nothing is mapped."""
    counts = {len(joined[k]) for k in ("handles", "sizes", "offsets", "chunk_sizes", "devices")}
    if joined["backend"] != backend or counts != {npes}:
        raise MonoUnsupported(
            f"the daemon's join reply does not fit this group: backend {joined['backend']!r} (hello named "
            f"{backend!r}), {sorted(counts)} buffers for {npes} ranks",
            "BAD_REQUEST",
        )
