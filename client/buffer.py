"""PeerBuffer: the seeds' symmetric peer memory, brokered by the peerd daemon."""

from __future__ import annotations

import logging
import os

from peerd.backends import mapper as backend_mapper
from peerd.protocol import MAX_REASON_CHARS

from .connection import GRACE_S, connection
from .errors import ForkedProcessError, MonoUnsupported
from .groupkey import Membership, remember, resolve
from .mappings import mappings
from .views import backend_for, byte_view, default_device, require_torch

log = logging.getLogger("peerd_client")

DEFAULT_NAME = "default"


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
    ProcessGroup. ``name`` tells apart several buffer sets of one group.
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
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
        torch = require_torch()
        self._pid = os.getpid()
        self._handles: list[bytes] = []
        self._released = True
        self._conn = conn = connection()
        wait = (timeout or conn.hello["rendezvous_timeout"]) + GRACE_S
        member = resolve(group, rank, npes, wait)
        self.rank, self.npes, self.nbytes, self.name = member.rank, member.npes, nbytes, name
        self.group_key = member.key
        self.device = torch.device(device) if device is not None else default_device()
        self._mapper = backend_mapper(backend_for(self.device))
        where = f"group={member.key} name={name} rank {member.rank}"

        try:
            joined = conn.call(
                "join",
                {
                    **self._slot(member),
                    "npes": member.npes,
                    "nbytes": nbytes,
                    "device": self._mapper.device_identity(self.device.index),
                    "flags": flags,
                    "timeout": timeout,
                },
                timeout=wait,
            )
        except MonoUnsupported as err:
            raise type(err)(f"peer memory rendezvous failed ({where}): {err}", err.code) from None
        self._released = False
        remember(member)

        failure, pointers = None, []
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # handles open in the current device's context
            for handle, size in zip(joined["handles"], joined["sizes"]):
                pointers.append(mappings.open(self._mapper, handle, size))
                self._handles.append(handle)
        except Exception as err:  # every rank must still reach the agreement
            failure = err
            log.warning("%s could not map a peer: %s", where, err)
        reason = "" if failure is None else f"{type(failure).__name__}: {failure}"[:MAX_REASON_CHARS]
        agreed_wait = (timeout or conn.hello["agreement_timeout"]) + GRACE_S
        try:
            verdict = conn.call(
                "commit",
                {**self._slot(member), "ok": failure is None, "reason": reason, "timeout": timeout},
                timeout=agreed_wait,
            )
        except MonoUnsupported as err:
            self.close()
            raise type(err)(f"peer memory agreement failed ({where}): {err}", err.code) from None
        if not verdict["ok"]:
            self.close()
            side = "this" if failure else "another"
            raise MonoUnsupported(
                f"peer memory handshake failed on {side} rank ({where}): {verdict['reason']}"
            ) from failure

        self._pointers = pointers
        self._local = self._pointers[self.rank]
        # a view, not an owner: close() unmaps the memory under it
        self._bytes = byte_view(self._local, nbytes, self.device)
        self._addresses = torch.tensor(self._pointers, dtype=torch.int64, device=self.device)

    def _slot(self, member: Membership) -> dict:
        return {"group": member.key, "name": self.name, "rank": member.rank}

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
        """A torch uint8 view of this rank's buffer (None once closed)."""
        self._guard()
        return getattr(self, "_bytes", None)

    @property
    def addresses(self):
        """int64 tensor on ``device`` of every rank's buffer address, by rank."""
        self._guard()
        return getattr(self, "_addresses", None)

    @property
    def pointers(self) -> list[int]:
        """``addresses`` as a list of ints."""
        self._guard()
        return list(getattr(self, "_pointers", []))

    def close(self) -> None:
        """Unmap every peer, then release this rank's hold; idempotent.

        The daemon frees the memory once every rank has released (or died), so
        closing never pulls memory from under a peer. Never raises: a daemon
        that went away has freed everything already.
        """
        self._close(wait=True)

    def _close(self, wait: bool) -> None:
        if os.getpid() != self._pid:
            return  # a forked child holds nothing of its parent's
        self._bytes = self._addresses = None
        self._local, self._pointers = 0, []
        handles, self._handles = self._handles, []
        for handle in handles:
            try:
                mappings.close(handle)
            except Exception as err:
                log.warning("unmapping a peer buffer of group=%s failed: %s", self.group_key, err)
        if self._released:
            return
        self._released = True
        slot = {"group": self.group_key, "name": self.name, "rank": self.rank}
        try:
            if wait:
                self._conn.call("release", slot)
            else:
                self._conn.send_later("release", slot)
        except MonoUnsupported as err:
            log.warning("release of group=%s name=%s rank %d: %s", self.group_key, self.name, self.rank, err)

    def __enter__(self) -> "PeerBuffer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self._close(wait=False)  # never block inside a garbage-collection pass
        except Exception:  # interpreter shutdown: nothing left to report to
            pass
