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


def problems(registry: Registry, devices: list[dict[str, Any]], now: float) -> list[str]:
    found = [
        f"device {d['index']} ({d['uuid']}) is unusable: {d['error']}" for d in devices if d.get("error")
    ]
    patience = registry.rendezvous_timeout + registry.agreement_timeout
    sets = registry.all_sets()
    for b in sets:
        age = now - b.created
        holders = sorted(s.pid for s in b.holding_slots())
        if b.state in (State.JOINING, State.OPENING) and age > patience:
            found.append(f"{b.label} has been {b.state.value} for {age:.0f}s, past its timeouts")
        elif b.state is State.FAILED and holders and age > patience:
            found.append(f"{b.label} failed {age:.0f}s ago and pids {holders} still hold it (see peerd evict)")
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
                found.append(f"{what} {key} holds {used} of at most {limit} bytes ({flag})")
    return found
