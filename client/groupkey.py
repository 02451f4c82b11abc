"""Turning the seeds' ``group`` argument into a daemon group key, rank and npes.

A string is the key itself (the caller passes rank and npes). A torch
ProcessGroup gives rank and npes, and a key unique to that group on this
node: its rank 0 writes a random token into the group's own store (a
PrefixStore private to the group) and every rank reads it back, so two jobs,
or two groups of one job, never share a key even on one node.

A group made again over the same store (``destroy_process_group``, then
``init_process_group`` with the same TCPStore) has the same store prefix,
where the earlier group's token still lies: a rank that came before rank 0
read it back and waited in another group than its peers. So each rank
counts itself in (``store.add``; a process resolves a group once, then
remembers its key) and the count names the instance whose token it reads;
a rank that gives up waiting for rank 0 counts itself out again.
"""

from __future__ import annotations

import datetime
import operator
import os
import sys
import threading
import uuid
from dataclasses import dataclass

from peerd.protocol import ErrorCode

from .errors import MonoUnsupported

STORE_KEY = "peerd/group-key"
COUNT_KEY = "peerd/group-key-count"


@dataclass(frozen=True)
class Membership:
    key: str
    rank: int
    npes: int
    single: bool = False  # group None: a key nobody names again, so none to remember


_pg_keys: dict[int, tuple[object, str]] = {}  # id(pg) -> (pg kept alive, key)
_lock = threading.Lock()
#: rank and npes of every string-keyed group joined, for tp_agree, and the pid
#: that joined it: a forked child inherits this table but none of the ranks
_joined: dict[str, tuple[Membership, int]] = {}


def _forget_after_fork() -> None:
    global _lock
    _lock = threading.Lock()  # a forked child must not inherit a lock held across store.wait


os.register_at_fork(after_in_child=_forget_after_fork)


def remember(member: Membership) -> None:
    if not member.single:
        _joined[member.key] = (member, os.getpid())


def joined_by(key: str) -> int | None:
    """The pid that joined a PeerBuffer of ``key`` (this process's parent, after a fork), if any did."""
    known = _joined.get(key)
    return known[1] if known else None


def _process_group_key(pg, rank: int, npes: int, timeout: float) -> str:
    import torch.distributed.distributed_c10d as c10d

    with _lock:
        cached = _pg_keys.get(id(pg))
        if cached is not None:
            return cached[1]
        store = c10d._get_process_group_store(pg)
        instance = (store.add(COUNT_KEY, 1) - 1) // npes  # the module's note
        slot = f"{STORE_KEY}/{instance}"
        if rank == 0:
            store.set(slot, uuid.uuid4().hex)
        try:
            store.wait([slot], datetime.timedelta(seconds=timeout))
        except RuntimeError as err:  # torch's DistStoreError: rank 0 has not come
            store.add(COUNT_KEY, -1)  # counted out: a later call on this group counts itself in again
            raise MonoUnsupported(
                f"rank 0 of process group {pg.group_name!r} did not give the group its peerd key within "
                f"{timeout:g}s ({err}): it has not reached its first PeerBuffer or tp_agree on this group, or "
                "it died; every rank makes the same calls on a group in the same order",
                ErrorCode.TIMEOUT.value) from None
        key = f"pg-{pg.group_name}-{store.get(slot).decode()}"
        _pg_keys[id(pg)] = (pg, key)
        return key


class Contradicted(ValueError):
    """rank=/npes= that contradict the place this process joined, or its process group's: ``member`` is
    that place, so the call can still tell its peers (a withdrawal, a no) before it raises."""

    def __init__(self, message: str, member: Membership):
        super().__init__(message)
        self.member = member


def integral(value):
    """An integer of any kind (numpy's, torch's: engines compute sizes and ranks with them) as an int;
    anything else as it is, for the protocol's checks to name (a bool is no count)."""
    if isinstance(value, bool) or str(getattr(value, "dtype", "")) == "torch.bool":
        return value
    try:
        return operator.index(value)
    except TypeError:  # a float, a string, a float tensor
        return value


def resolve(group, rank: int | None, npes: int | None, timeout: float) -> Membership:
    """The membership ``group`` names; ValueError where it cannot be known: Contradicted where rank= or
    npes= contradict the place this process joined, or its process group's (once that group's key was
    had: where its rank 0 never gives it, only after ``timeout``). MonoUnsupported (TIMEOUT) where a
    process group's rank 0 did not give its key within ``timeout``."""
    rank, npes = integral(rank), integral(npes)
    if group is None:  # the seeds' single rank: a key of its own, which no other set shares
        if rank not in (None, 0) or npes not in (None, 1):
            raise ValueError(f"group None is a single rank: rank={rank}, npes={npes} name more")
        return Membership(f"single-{uuid.uuid4().hex}", 0, 1, single=True)
    if isinstance(group, str):
        if rank is None or npes is None:
            known = _joined.get(group)
            if known is None:
                raise ValueError(
                    f"group {group!r} is a string key: pass rank= and npes= "
                    "(or join a PeerBuffer of that group in this process first)"
                )
            member = known[0]
            if rank not in (None, member.rank) or npes not in (None, member.npes):
                wrong = f"rank={rank}, npes={npes} contradict this process's place in group {group!r} (rank " \
                        f"{member.rank} of {member.npes})"
                raise Contradicted(wrong, member) if known[1] == os.getpid() else ValueError(wrong)  # a parent's
            return member
        return Membership(group, rank, npes)
    if hasattr(group, "rank") and hasattr(group, "size"):
        import torch.distributed as dist

        pg_rank, pg_size = dist.get_rank(group), dist.get_world_size(group)
        if (rank, npes) in ((None, None), (pg_rank, pg_size)):
            return Membership(_process_group_key(group, pg_rank, pg_size, timeout), pg_rank, pg_size)
        wrong = f"rank={rank}, npes={npes} contradict the process group (rank {pg_rank} of {pg_size}): pass " \
                "neither with a process group"
        try:
            key = _process_group_key(group, pg_rank, pg_size, timeout)
        except MonoUnsupported:  # its rank 0 never came: nobody to tell, the mistake is the error
            raise ValueError(wrong) from None
        raise Contradicted(wrong, Membership(key, pg_rank, pg_size))
    dist = sys.modules.get("torch.distributed")
    if dist is not None and type(group) is type(dist.GroupMember.NON_GROUP_MEMBER) and \
            group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError("this process is not a member of that process group (dist.new_group gave it "
                         "GroupMember.NON_GROUP_MEMBER): only the group's ranks build its PeerBuffer or agree in it")
    raise TypeError(f"group must be a string key, a torch ProcessGroup or None (a single rank), "
                    f"not {type(group).__name__}")
