"""What makes a serving daemon degraded rather than healthy, for `peerd status` and probes.

Healthy: every device usable, nothing stuck, every limit comfortably away.
Degraded: the daemon answers but an operator should look: a device failed
its check, a buffer set stays unsettled long past its timeouts (or failed and
is still held: a candidate for `peerd evict`), or a limit is nearly reached.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .buffersets import State
from .registry import Registry

NEARLY = 0.9  # a limit counts as nearly reached at 90 %

#: How often finding the stuck sets may walk every buffer set: a status request in between reads the
#: last walk, so a user asking for status in a loop costs the daemon one walk a second, not one a request
#: (4000 sets held: about 10 ms each). A set is stuck only long past its timeouts, so nothing is missed.
SCAN_EVERY_S = 1.0


@dataclass(frozen=True)
class Stuck:
    """A buffer set unsettled long past its timeouts, or failed and still held, as the last walk found it."""

    owner_uid: int | None
    label: str
    state: State
    age: float
    holders: list[int]


class StuckSets:
    """The stuck sets, found by a walk over every set at most once per SCAN_EVERY_S."""

    def __init__(self) -> None:
        self._found: list[Stuck] = []
        self._at: float | None = None

    def scan(self, registry: Registry, now: float) -> list[Stuck]:
        if self._at is None or not 0 <= now - self._at < SCAN_EVERY_S:
            patience = registry.rendezvous_timeout + registry.agreement_timeout
            found = []
            for b in registry.all_sets():
                age, holders = now - b.created, sorted(s.pid for s in b.holding_slots())
                unsettled = b.state in (State.JOINING, State.OPENING)
                if age > patience and (unsettled or (b.state is State.FAILED and holders)):
                    found.append(Stuck(b.owner_uid, b.label, b.state, age, holders))
            self._found, self._at = found, now
        return self._found


def problems(registry: Registry, devices: list[dict[str, Any]], stuck: list[Stuck], viewer: int | None = None) -> list[str]:
    """Each reason the daemon is degraded, as ``viewer`` may read it; ``stuck``: ``StuckSets.scan``'s.

    The verdict is the same for every caller (a probe must see degraded), but
    only an administrator (or None: the daemon's own log and STATUS= line)
    reads other users' group names, pids and uids; anyone else reads that a
    set of another user is stuck.
    """
    sees_all = viewer is None or viewer in registry.admins
    found = [
        f"device {d['index']} ({d['uuid']}) is unusable: {d['error']}" for d in devices if d.get("error")
    ]
    for b in stuck:
        own = sees_all or b.owner_uid == viewer
        label = b.label if own else "a buffer set of another user"
        if b.state is State.FAILED:
            held_by = f"pids {b.holders}" if own else "its processes"
            found.append(f"{label} failed {b.age:.0f}s ago and {held_by} still hold it (see peerd evict)")
        else:
            found.append(f"{label} has been {b.state.value} for {b.age:.0f}s, past its timeouts")
    limits = registry.limits
    if limits.max_groups is not None:
        held = registry.sets_counted_toward_max_groups()
        if held >= NEARLY * limits.max_groups:
            found.append(f"{held} buffer sets held of at most {limits.max_groups} (--max-groups)")
    for table, limit, what, flag in (
        (registry.bytes_by_uid, limits.max_bytes_per_uid, "uid", "--max-bytes-per-uid"),
        (registry.bytes_by_device, limits.max_bytes_per_device, "device", "--max-bytes-per-device"),
    ):
        if limit is None:
            continue
        for key, used in table.items():
            if used >= NEARLY * limit:
                who = key if sees_all or what == "device" or key == viewer else "(another user)"
                found.append(f"{what} {who} holds {used} of at most {limit} bytes ({flag})")
    return found
