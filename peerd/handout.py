"""The fd channel's answer: a member's set memory as fds, or its control page's area.

Apart from the loop (peerd.server) so the rule reads in one place: only a caller the
allowlist admits (its supplementary groups as the kernel recorded them on the fd channel's
connection), holding the rank it names in a set whose handles went out
(Registry.opened_set), receives anything.
"""

from __future__ import annotations

from typing import Any

from .access import Allowlist, GroupSource
from .admission import forbidden
from .backends import MemoryBackend
from .credentials import Credentials
from .ops import validate_request
from .pages import Pages
from .protocol import ErrorCode, ProtocolError
from .registry import Registry


def member_fds(registry: Registry, backend: MemoryBackend, pages: Pages, allowlist: Allowlist,
               who: Credentials, groups: GroupSource, request: Any) -> tuple[list[bytes], list[int]]:
    """The handles and fds of the set in which ``who`` holds the rank asked for (or its page's area and alive
    pipe); ``groups``: its supplementary groups, read off its connection only if the allowlist needs them."""
    if not allowlist.admits(who.uid, who.gid, groups):
        raise forbidden(who)
    wants_page, request = pages.split_request(request)
    bset = registry.opened_set(validate_request("release", request), who)  # a slot, named as release names it
    if wants_page:
        return pages.handout(bset)
    allocations = [bset.slots[r].allocation for r in range(bset.npes)]
    fds = [backend.fd(a) for a in allocations]
    if None in fds:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"the {backend.name} backend passes no fds: its handles open the memory")
    return [a.handle for a in allocations], fds
