"""The all-reduce kernel stops on the group's abort word and on its deadline.

Worker processes share GPU 0. In the first tests they share one control page
(the fd inherited) and the test plays the daemon: it kills or stops a rank
and writes the abort from another process. In the wired tests each
PeerBuffer has the page the daemon made for its set, and the daemon itself
aborts it when a rank dies or the group is evicted. Every waiting rank's call must raise, and its CUDA context
must still run a kernel, a new allocation and a new PeerBuffer.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from peerd.controlpage import AbortCode, new_instance_id
from tests.gpu.test_cuda import REASON, cuda_daemon  # noqa: F401 (the fixture)
from tests.integration.test_controlpage_agree import abort_from_another_process
from tests.forkserver import popen
from tests.pagekit import OwnPage

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=REASON or "")]

RANK = str(Path(__file__).resolve().parents[1] / "abort_rank.py")


STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def no_rank_outlives_its_test():
    """A test that fails half-way would leave its waiters spinning in a kernel with no deadline and its
    holder asleep, on the GPU every later test shares: kill whatever of its ranks still runs."""
    yield
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)


def start(daemon, page: OwnPage | None, group: str, npes: int, *args: str) -> list[subprocess.Popen]:
    """Ranks 0..npes-2 wait in the kernel, rank npes-1 holds back; without ``page``, each
    polls its buffer's own control page (the wired path), which it announces first."""
    fd = ("--page-fd", str(page.fd)) if page is not None else ()
    procs = [
        popen(
            [sys.executable, RANK, "--rank", str(r), "--npes", str(npes), "--group", group, *fd,
             "--waiters", str(npes - 1), "--role", "holder" if r == npes - 1 else "waiter", *args],
            pass_fds=(page.fd,) if page is not None else (), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=daemon.env(),
        )
        for r in range(npes)
    ]
    STARTED.extend(procs)
    if page is None:
        for p in procs:
            line = p.stdout.readline()
            assert line and json.loads(line)["wired"] != 0, f"no control page: {line!r} {p.stderr.read()}"
    return procs


def announced(proc: subprocess.Popen, what: str) -> None:
    line = proc.stdout.readline()
    assert line and what in json.loads(line), f"{line!r}: {proc.stderr.read() if not line else ''}"


def result(proc: subprocess.Popen) -> dict:
    """The rank's last line (read line by line: its first lines were read so already)."""
    line = proc.stdout.readline()
    assert line, f"rank exited {proc.wait(timeout=120)}: {proc.stderr.read()}"
    proc.wait(timeout=120)
    return json.loads(line)


def check_waiters(waiters, raised: str, reason: str) -> None:
    for r in map(result, waiters):
        assert r["raised"] is not None and r["raised"]["type"] == raised and reason in r["raised"]["message"], r
        assert r["after"] == {"kernel": 2000.0, "allocation": 1, "sum": float(len(waiters))}, r


@pytest.mark.parametrize("npes", [2, 4, 8])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph-replay"])
def test_a_killed_rank_and_the_abort_stop_every_peer_kernel(cuda_daemon, npes, graph):  # noqa: F811
    with OwnPage(npes, new_instance_id()) as page:
        procs = start(cuda_daemon, page, f"abort{npes}{'g' if graph else ''}", npes, *(["--graph"] if graph else []))
        *waiters, holder = procs
        announced(holder, "holding")
        for p in waiters:
            announced(p, "calling")
        holder.kill()
        holder.wait()
        abort_from_another_process(page, AbortCode.MEMBER_DIED, f"rank {npes - 1} (pid {holder.pid}) died")
        check_waiters(waiters, "MonoUnsupported", f"rank {npes - 1} (pid {holder.pid}) died")


def test_an_abort_stops_the_kernels_while_every_process_lives(cuda_daemon):  # noqa: F811
    with OwnPage(4, new_instance_id()) as page:
        *waiters, holder = start(cuda_daemon, page, "abort-live", 4)
        announced(holder, "holding")
        for p in waiters:
            announced(p, "calling")
        abort_from_another_process(page, AbortCode.EVICTED, "group=abort-live was evicted by an administrator")
        check_waiters(waiters, "MonoUnsupported", "evicted by an administrator")
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("wired", [False, True], ids=["explicit-page", "daemon-page"])
def test_a_stopped_rank_makes_its_peers_time_out_at_their_deadline(cuda_daemon, wired):  # noqa: F811
    """SIGSTOP is no death: until a peer has seen the rank stopped for PEERD_STOPPED_ABORT_S (20 s), nothing
    aborts, so a shorter all-reduce deadline is what ends the peers' wait."""
    with contextlib.nullcontext() if wired else OwnPage(3, new_instance_id()) as page:
        *waiters, holder = start(cuda_daemon, page, "wired-stop" if wired else "abort-stop", 3, "--deadline", "2")
        announced(holder, "holding")
        holder.send_signal(signal.SIGSTOP)
        try:
            for p in waiters:
                announced(p, "calling")
            check_waiters(waiters, "TimeoutError", "within its deadline of 2.0s")
        finally:
            holder.kill()
            holder.wait()


def test_a_rank_stopped_past_the_grace_ends_its_peers_kernels_without_a_deadline(cuda_daemon):  # noqa: F811
    """SIGSTOP is no death, and the daemon sees nothing: a peer that has seen the rank stopped for
    PEERD_STOPPED_ABORT_S aborts the group's page, and every waiting kernel exits with the reason."""
    cuda_daemon.extra_env["PEERD_STOPPED_ABORT_S"] = "2"
    *waiters, holder = start(cuda_daemon, None, "wired-stopped", 3)
    announced(holder, "holding")
    holder.send_signal(signal.SIGSTOP)
    try:
        for p in waiters:
            announced(p, "calling")
        check_waiters(waiters, "MonoUnsupported", f"rank 2 (pid {holder.pid}), a peer of group=wired-stopped")
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("npes", [2, 4, 8])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph-replay"])
def test_the_daemon_aborts_every_peer_kernel_when_a_rank_is_killed_inside_it(cuda_daemon, npes, graph):  # noqa: F811
    group = f"wired{npes}{'g' if graph else ''}"
    *waiters, holder = start(cuda_daemon, None, group, npes, *(["--graph"] if graph else []))
    announced(holder, "holding")
    for p in waiters:
        announced(p, "calling")
    holder.kill()
    holder.wait()
    check_waiters(waiters, "MonoUnsupported", f"rank {npes - 1} (pid {holder.pid}) of group={group} name=default died")


def test_an_eviction_aborts_the_kernels_of_live_processes_before_freeing(cuda_daemon):  # noqa: F811
    *waiters, holder = start(cuda_daemon, None, "wired-evict", 3)
    announced(holder, "holding")
    for p in waiters:
        announced(p, "calling")
    assert cuda_daemon.cli("evict", "wired-evict", "--yes").returncode == 0
    check_waiters(waiters, "MonoUnsupported", "evicted by an administrator")
    holder.kill()
    holder.wait()
