"""What makes a serving daemon degraded rather than healthy, for `peerd status` and probes.

Healthy: every device usable, nothing stuck, every limit comfortably away.
Degraded: the daemon answers but an operator should look: a device failed
its check, a buffer set stays unsettled long past its timeouts (or failed and
is still held: a candidate for `peerd evict`), or a limit is nearly reached.
"""

from __future__ import annotations

from typing import Any

from .buffersets import State
from .registry import Registry

NEARLY = 0.9  # a limit counts as nearly reached at 90 %


def problems(registry: Registry, devices: list[dict[str, Any]], now: float, viewer: int | None = None) -> list[str]:
    """Each reason the daemon is degraded, as ``viewer`` may read it.

    The verdict is the same for every caller (a probe must see degraded), but
    only an administrator (or None: the daemon's own log and STATUS= line)
    reads other users' group names, pids and uids; anyone else reads that a
    set of another user is stuck.
    """
    sees_all = viewer is None or viewer in registry.admins
    found = [
        f"device {d['index']} ({d['uuid']}) is unusable: {d['error']}" for d in devices if d.get("error")
    ]
    patience = registry.rendezvous_timeout + registry.agreement_timeout
    sets = registry.all_sets()
    for b in sets:
        age = now - b.created
        holders = sorted(s.pid for s in b.holding_slots())
        label = b.label if sees_all or b.owner_uid == viewer else "a buffer set of another user"
        if b.state in (State.JOINING, State.OPENING) and age > patience:
            found.append(f"{label} has been {b.state.value} for {age:.0f}s, past its timeouts")
        elif b.state is State.FAILED and holders and age > patience:
            held_by = f"pids {holders}" if sees_all or b.owner_uid == viewer else "its processes"
            found.append(f"{label} failed {age:.0f}s ago and {held_by} still hold it (see peerd evict)")
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
