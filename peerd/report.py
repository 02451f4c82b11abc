"""What `peerd status` and hello answer: the daemon's picture, assembled apart from its loop.

Reads the daemon's parts and changes nothing, so the loop (peerd.server) stays about
serving, and what a caller may see is decided here: other users' groups only for
administrators (peerd.health.problems).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from . import __version__
from .backends import MemoryBackend
from .health import NEARLY, Stuck, problems
from .protocol import VERSION
from .registry import Registry

#: problems `peerd status` lists at most (each stuck set is one)
MAX_PROBLEMS_SHOWN = 20


def hello(registry: Registry, backend: MemoryBackend, instance: int) -> dict[str, Any]:
    """Who answers, which run of it (``instance``: a set or page of another run is never trusted), and the
    deadlines it applies unless a caller sends its own."""
    return {
        "instance": instance,
        "version": __version__,
        "protocol": VERSION,
        "pid": os.getpid(),
        "backend": backend.name,
        "rendezvous_timeout": registry.rendezvous_timeout,
        "agreement_timeout": registry.agreement_timeout,
    }


def status(registry: Registry, backend: MemoryBackend, instance: int, viewer: int, loop: dict[str, Any],
           stuck: list[Stuck]) -> dict[str, Any]:
    """What `peerd status` shows ``viewer``; ``loop`` holds the serving loop's own facts (connections, drain),
    ``stuck`` the stuck sets its last walk found (peerd.health.StuckSets).

    Another user's groups, connection counts and arena chunks show only to administrators.
    """
    devices = backend.devices()
    connections = loop["connections"]
    if viewer not in registry.admins:  # who else is connected, and holds what, is the administrators' business
        own = [e for e in connections["top_uids"] if e[0] == viewer]
        loop = {**loop, "connections": {**connections, "top_uids": own},
                "reload_failed": loop["reload_failed"] and "the last reload of the configuration failed (the daemon's "
                                                           "log says why)"}
        devices = [{**d, "arenas": [a for a in d.get("arenas", []) if a["uid"] == viewer]} for d in devices]
    found = problems(registry, devices, stuck, viewer)
    if connections["open"] >= NEARLY * connections["max"]:
        found.append(f"{connections['open']} connections held of at most {connections['max']} (--max-connections)")
    if loop["draining"]:  # joins are refused: a readiness probe must send no new job here
        found.append("draining after SIGTERM: new joins are refused until the daemon is restarted")
    if loop["metrics_unserved"]:  # a port another local user holds, or the daemon's user may not bind
        found.append(f"metrics (--metrics-port): {loop['metrics_unserved']}")
    if loop["reload_failed"]:  # what the file says, for the administrators; that it failed, for every probe
        found.append(loop["reload_failed"])
    if len(found) > MAX_PROBLEMS_SHOWN:
        found[MAX_PROBLEMS_SHOWN - 1:] = [f"and {len(found) - MAX_PROBLEMS_SHOWN + 1} more problems"]
    return {
        **hello(registry, backend, instance),
        "health": "degraded" if found else "healthy",
        "problems": found,
        **loop,
        "limits": dataclasses.asdict(registry.limits),
        "devices": devices,
        "groups": registry.set_count(),
        "ranks_held": registry.ranks_holding(),
        "bytes_allocated": sum(registry.bytes_by_device.values()),
        "agreements_pending": len(registry.agreements),
    }
