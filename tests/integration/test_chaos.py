"""Chaos: rounds of real ranks, one SIGKILLed at a random protocol step, then the daemon itself,
on both agreement paths (the control page, and the daemon's messages).

Every round asserts that no survivor waited past its timeout, that the
survivors agree on one outcome naming the cause, and that afterwards the
daemon holds nothing for the group and no shared memory is left. Rounds and
seed come from PEERD_CHAOS_ROUNDS (default 1 pass over every step) and
PEERD_CHAOS_SEED, so a long soak is one environment variable away.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time

import pytest

from tests.conftest import finish, memfd_holders, run_ranks, start_rank, wait_until
from tests.rank import STEPS

NPES = 3
TIMEOUT = 4.0
SLACK = 3.0  # process start-up and connect, on top of the protocol's own timeout
PASSES = int(os.environ.get("PEERD_CHAOS_ROUNDS", "1"))
SEED = int(os.environ.get("PEERD_CHAOS_SEED", "20261202"))


def expected(step: str, victim: int, pid: int):
    """The one outcome every survivor must report, as (stage, code, words in the message or agreed)."""
    return {
        "before_join": ("join", "TIMEOUT", f"rank(s) [{victim}] of {NPES} never joined"),
        "in_rendezvous": ("join", "RANK_DIED", f"rank {victim} (pid {pid})"),
        "after_handles": ("join", "GROUP_FAILED", f"rank {victim} (pid {pid})"),
        "in_agreement": ("done", None, False),
        "after_ready": ("done", None, True),
        "in_close": ("done", None, True),
    }[step]


@pytest.fixture(params=["page", "messages"])
def daemon(request, daemon):
    """Each test on both agreement paths: the control page, and the daemon's messages."""
    if request.param == "messages":
        daemon.stop()
        daemon.args = ("--control-pages", "false")
        daemon.start()
    return daemon


def pages_on(daemon) -> bool:
    return "--control-pages" not in daemon.args


def held_by(daemon, group):
    listing = json.loads(daemon.cli("ls", "--json").stdout)
    return [(g["held"], g["bytes_allocated"]) for g in listing if g["group"] == group and (g["held"] or g["bytes_allocated"])]


def kill_one_rank(daemon, step: str, victim: int, group: str) -> None:
    args = ("--group", group, "--timeout", str(TIMEOUT))
    others = [r for r in range(NPES) if r != victim]
    procs = {}
    if step == "in_rendezvous":
        # the victim and all but one survivor join; the victim is killed while they wait
        procs[victim] = start_rank(daemon, "chaos", victim, NPES, *args)
        for r in others[:-1]:
            procs[r] = start_rank(daemon, "chaos", r, NPES, *args)
        joined = [f"group={group} name=default rank={r} " for r in [victim, *others[:-1]]]
        wait_until(lambda: all(j in daemon.logs() for j in joined), 90, "the early ranks to join")
        procs[victim].send_signal(signal.SIGKILL)
        procs[others[-1]] = start_rank(daemon, "chaos", others[-1], NPES, *args)
    else:
        for r in range(NPES):
            extra = ("--die-at", step) if r == victim else ()
            procs[r] = start_rank(daemon, "chaos", r, NPES, *args, *extra)
    survivors = {r: finish(procs[r], timeout=60) for r in others}
    assert procs[victim].wait(timeout=60) == -signal.SIGKILL, f"the victim did not die at {step}"

    stage, code, words = expected(step, victim, procs[victim].pid)
    for rank, result in survivors.items():
        assert result["elapsed"] < TIMEOUT + SLACK, f"rank {rank} waited {result['elapsed']:.1f}s at {step}"
        assert result["stage"] == stage, (step, rank, result)
        if stage == "done":
            assert result["agreed"] is words, (step, rank, result)
            assert result["page"] is pages_on(daemon), (step, rank, result)
        else:
            assert result["code"] == code and words in result["message"], (step, rank, result)
    wait_until(lambda: held_by(daemon, group) == [], 10, f"the daemon to hold nothing for {group}")
    assert daemon.settled_segments() == [], f"shared memory left after {step}"


def test_one_rank_killed_at_every_protocol_step(daemon):
    rng = random.Random(SEED)
    rounds = [step for _ in range(PASSES) for step in rng.sample(STEPS, len(STEPS))]
    for n, step in enumerate(rounds):
        kill_one_rank(daemon, step, rng.randrange(NPES), f"chaos-{n}-{step}")


@pytest.mark.parametrize("delay", [0.3, 1.5])
def test_the_daemon_killed_mid_protocol_then_restarted(daemon, delay):
    args = ("--group", f"doomed-{delay}", "--timeout", str(TIMEOUT))
    procs = [start_rank(daemon, "chaos", r, NPES, *args) for r in range(NPES)]
    time.sleep(delay)
    held = set(daemon.segments())
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.proc.wait()
    for result in (finish(p, timeout=60) for p in procs):
        assert result["elapsed"] < TIMEOUT + SLACK, result
        if result["stage"] != "done":
            assert any(w in result["message"] for w in ("went away", "no peerd daemon socket", "did not answer")), result
    assert not memfd_holders(held), "the dead daemon's memory died with it and its ranks"
    daemon.start()
    assert all(r["ok"] for r in run_ranks(daemon, "exchange", NPES, "--group", f"reborn-{delay}"))
