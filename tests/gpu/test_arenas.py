"""Arenas on a real GPU: a cuda daemon, worker processes sharing GPU 0.

Run on a GPU machine with `python -m pytest tests/gpu/test_arenas.py`; skipped
without a CUDA GPU or cuda-bindings (see tests/gpu/test_cuda.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests import arena_rank
from tests.conftest import Daemon, finish, start_rank, wait_until
from tests.gpu.test_cuda import REASON, used_bytes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=REASON or "")]

MiB = 1 << 20


def cuda_daemon(socket_dir: str, *args: str) -> Daemon:
    return Daemon(os.path.join(socket_dir, "peerd.sock"), Path(socket_dir) / "daemon.log", args=args,
                  backend="cuda").start()


def arenas(d: Daemon) -> list[dict]:
    (device,) = json.loads(d.cli("status", "--json").stdout)["devices"]
    return device["arenas"]


def test_a_dirtied_freed_buffer_comes_back_zeroed(socket_dir):
    d = cuda_daemon(socket_dir, "--arena-idle-s", "30", "--arena-chunk-bytes", "2MiB")  # the set fills it
    try:
        for p in arena_rank.start(d, "reuse", 2, "--group", "dirty", "--device", "cuda", "--nbytes", str(MiB)):
            r = finish(p, 300)
            assert r["ok"] and r["same_range"], r
            assert r["zero"], "a reused range must read zero"
    finally:
        assert d.stop() == 0, d.logs()


def test_sets_of_8_kib_cost_at_most_64_kib_per_rank(socket_dir):
    d = cuda_daemon(socket_dir, "--arena-idle-s", "30")
    try:
        ranks = [start_rank(d, "join", r, 8, "--group", "pads", "--nbytes", str(8 << 10), "--hold", "-1",
                            stdin=subprocess.PIPE) for r in range(8)]
        wait_until(lambda: "group=pads name=default live" in d.logs(), 300, "the set to go live")
        (entry,) = json.loads(d.cli("ls", "--json").stdout)
        assert entry["bytes_allocated"] / 8 <= 64 << 10, entry
        (usage,) = arenas(d)
        assert usage["chunks"] == 1 and usage["handed_out_bytes"] == 8 * (8 << 10), usage
        print(f"8 ranks x 8 KiB: {entry['bytes_allocated'] // 8} bytes per rank, one chunk of "
              f"{usage['reserved_bytes'] // MiB} MiB shared by the uid's sets on this GPU")
        for p in ranks:
            p.stdin.write("go\n")
            p.stdin.flush()
            assert finish(p, 300)["ok"]
    finally:
        assert d.stop() == 0, d.logs()


def test_idle_chunks_go_back_and_the_daemon_footprint_is_unchanged(socket_dir):
    d = cuda_daemon(socket_dir, "--arena-idle-s", "1")
    try:
        (device,) = json.loads(d.cli("status", "--json").stdout)["devices"]
        assert 0 < device["footprint_bytes"] <= 300 * MiB, "the arena must not grow the daemon's context"
        baseline = used_bytes()
        for p in arena_rank.start(d, "two_sets", 2, "--group", "idle", "--device", "cuda", "--nbytes", str(MiB)):
            r = finish(p, 300)
            assert r["ok"] and r["same_chunk"] and r["driver_opens"] == 0, r
        wait_until(lambda: arenas(d) == [], 10, "the empty chunk to go back to the driver")
        time.sleep(1.0)  # the workers' contexts go with their processes
        grown = used_bytes() - baseline
        print(f"device memory after the chunk went back: {grown / MiB:+.1f} MiB against the idle daemon")
        assert grown < 4 * MiB, "the chunk (and the zeroing stream) must not stay on the device"
    finally:
        assert d.stop() == 0, d.logs()
