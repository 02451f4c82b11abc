"""tp_agree on one control page shared by real rank processes (the page's fd
inherited), and aborts written by another process: what the daemon will do."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from peerd.controlpage import AbortCode, new_instance_id
from peerd_client.allreduce import Layout, all_reduce
from peerd_client.errors import MonoUnsupported
from tests.forkserver import popen
from tests.integration.test_allreduce import fake_buffers
from tests.pagekit import OwnPage

RANK = str(Path(__file__).resolve().parents[1] / "page_rank.py")
ROOT = str(Path(__file__).resolve().parents[2])


@pytest.fixture
def page_of():
    pages = []

    def make(npes: int) -> OwnPage:
        pages.append(OwnPage(npes, new_instance_id(), generation=1))
        return pages[-1]

    yield make
    for p in pages:
        p.close()


def start(page: OwnPage, rank: int, *args: str) -> subprocess.Popen:
    return popen(
        [sys.executable, RANK, "--fd", str(page.fd), "--rank", str(rank), "--npes", str(page.npes),
         "--instance", hex(page.instance), *args],
        pass_fds=(page.fd,), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=ROOT,
    )


def line(proc: subprocess.Popen) -> dict:
    text = proc.stdout.readline()
    assert text, f"rank exited {proc.wait()}: {proc.stderr.read()}"
    return json.loads(text)


def summary(proc: subprocess.Popen) -> dict:
    """The rank's last line, once it exited cleanly."""
    last = line(proc)
    while "done" not in last:
        last = line(proc)
    assert proc.wait(timeout=120) == 0, proc.stderr.read()
    return last


def word(address: int) -> int:
    return ctypes.c_int64.from_address(address).value


def abort_from_another_process(page: OwnPage, code: AbortCode, reason: str) -> None:
    """What the daemon does: map the page's area from its fd and write the abort."""
    subprocess.run(
        [sys.executable, "-c", "import sys; from peerd.pagearea import Area; "
         "Area.attach(int(sys.argv[1])).page(0, int(sys.argv[2])).abort(int(sys.argv[3]), sys.argv[4])",
         str(page.fd), str(page.npes), str(int(code)), reason],
        pass_fds=(page.fd,), check=True, cwd=ROOT, timeout=60,
    )


@pytest.mark.parametrize("npes", [2, 4, 8])
def test_every_rank_gets_the_and_of_every_round(page_of, npes):
    page = page_of(npes)
    rounds = 300
    procs = [start(page, r, "--rounds", str(rounds)) for r in range(npes)]
    for r in map(summary, procs):
        assert r["rounds"] == rounds and r["failures"] == [], r["failures"]


@pytest.mark.parametrize("npes", [2, 4])
def test_rounds_that_time_out_at_random_get_one_verdict_on_every_rank(page_of, npes):
    page = page_of(npes)
    procs = [start(page, r, "--rounds", "400", "--jitter", "7") for r in range(npes)]
    results = [summary(p) for p in procs]
    assert all(r["failures"] == [] for r in results), [r["failures"] for r in results]
    assert len({r["verdicts"] for r in results}) == 1, "a round's verdict is one for every rank, timed out or not"


def test_a_killed_rank_and_the_abort_wake_every_waiter_with_the_reason(page_of):
    page = page_of(4)
    procs = [start(page, r, "--rounds", "21", "--report", "21") for r in range(3)]
    dead = start(page, 3, "--rounds", "21", "--hold-at", "21")  # never votes in round 21
    for p in procs:
        assert line(p) == {"entering": 21}
    dead.kill()
    dead.wait()
    abort_from_another_process(page, AbortCode.MEMBER_DIED, f"rank 3 (pid {dead.pid}) died")
    for p in procs:
        verdict = line(p)
        assert verdict["round"] == 21 and verdict["ok"] is False
        assert f"aborted (MEMBER_DIED): rank 3 (pid {dead.pid}) died" in verdict["reason"]
        assert summary(p)["failures"] == []
    with pytest.raises(Exception, match="MEMBER_DIED"):
        page.check()


def test_a_stopped_rank_times_its_peers_out_and_then_finds_its_round_false(page_of):
    page = page_of(3)
    common = ("--rounds", "10", "--report", "6", "--short-at", "6", "--short", "1.5")
    peers = [start(page, r, *common) for r in range(2)]
    stopped = start(page, 2, *common, "--hold-at", "6")
    for p in peers:
        assert line(p) == {"entering": 6}
    stopped.send_signal(signal.SIGSTOP)
    try:
        for p in peers:
            verdict = line(p)
            assert verdict["ok"] is False and "round 6 of group=test timed out" in verdict["reason"], verdict
            assert "waiting for rank(s) [2]" in verdict["reason"], "the stopped rank is named, whoever gave up first"
    finally:
        stopped.send_signal(signal.SIGCONT)
    stopped.stdin.write("go\n")
    stopped.stdin.flush()
    assert line(stopped) == {"entering": 6}
    late = line(stopped)
    assert late["ok"] is False and "timed out: rank" in late["reason"], "a round that timed out is False later too"
    for p in [*peers, stopped]:  # rounds 7-10 agree normally again
        assert summary(p)["failures"] == []


def test_the_host_all_reduce_raises_the_abort_reason(page_of):
    page = page_of(2)
    ranks = fake_buffers(2, 8192)  # rank 1 never calls: rank 0 waits until the abort
    layout = Layout(2, 8192)

    def abort_once_rank0_waits():
        while word(ranks[1].local + layout.flag(0)) == 0:  # rank 0 reached step 3
            time.sleep(0.01)
        abort_from_another_process(page, AbortCode.EVICTED, "group=local was evicted by an administrator")

    aborter = threading.Thread(target=abort_once_rank0_waits)
    aborter.start()
    try:
        with pytest.raises(MonoUnsupported, match="aborted \\(EVICTED\\): group=local was evicted") as err:
            all_reduce(ranks[0], torch.ones(4), timeout=600, abort=page)
    finally:
        aborter.join()
    assert err.value.code == "GROUP_FAILED"
    with pytest.raises(MonoUnsupported, match="EVICTED"):  # an aborted group's call touches no peer
        all_reduce(ranks[1], torch.ones(4), abort=page)
    assert word(ranks[0].local + layout.flag(1)) == 0 and word(ranks[1].local) == 0


def test_an_instance_the_client_does_not_expect_is_refused(page_of):
    page = page_of(2)
    proc = subprocess.run(
        [sys.executable, RANK, "--fd", str(page.fd), "--rank", "0", "--npes", "2", "--rounds", "1",
         "--instance", hex(page.instance ^ 1)],
        pass_fds=(page.fd,), capture_output=True, text=True, cwd=ROOT, timeout=60,
    )
    assert proc.returncode != 0 and "StaleInstance" in proc.stderr and "restarted" in proc.stderr
    assert os.fstat(page.fd).st_size == page.size


def test_a_kernel_is_never_given_the_page_at_its_host_address(page_of):
    page = page_of(1)
    (buf,) = fake_buffers(1, 8192)
    buf.addresses = buf.addresses.to("meta")  # any device but the host: the kernel path
    with pytest.raises(TypeError, match="MappedPage"):
        all_reduce(buf, torch.ones(4, device="meta"), abort=page)
