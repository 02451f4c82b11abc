"""PeerBuffer and tp_agree end to end: a real daemon, real rank processes, real shared memory."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.conftest import Daemon, finish, run_ranks, start_rank, wait_until


@pytest.mark.parametrize("npes", [2, 4, 8])
def test_every_rank_reads_what_every_peer_wrote(daemon, npes):
    nbytes = 3 * 4096 + 5  # not a page multiple: the last byte must still be reachable
    results = run_ranks(daemon, "exchange", npes, "--nbytes", str(nbytes), "--group", f"x{npes}")
    for rank, r in enumerate(results):
        assert r["ok"], r
        assert r["zero"], "a fresh buffer must be zero-filled"
        assert r["seen"] == [[peer + 1, peer + 1] for peer in range(npes)]
        assert r["local_is_mine"] and r["rank"] == rank and r["npes"] == npes and r["nbytes"] == nbytes
        assert r["addresses_dtype"] == "torch.int64" and len(set(r["addresses"])) == npes
        assert r["closed"], "close() twice must leave the buffer closed, not raise"
    assert daemon.settled_segments() == [], "segments left after every rank released"
    assert daemon.cli("ls", "--json").stdout.strip() == "[]"


def test_agreement_is_the_and_of_every_vote_round_by_round(daemon):
    votes = {0: "1,1,0,1", 1: "1,0,1,1", 2: "1,1,1,1"}
    procs = [start_rank(daemon, "agree", r, 3, "--votes", votes[r], "--group", "votes") for r in range(3)]
    results = [finish(p) for p in procs]
    for r in results:
        assert r["ok"], r
        assert r["results"] == [True, False, False, True]


def test_agreement_waits_for_a_late_rank(daemon):
    early = [start_rank(daemon, "agree", r, 2, "--votes", "1", "--group", "late") for r in (0,)]
    time.sleep(1.0)
    late = start_rank(daemon, "agree", 1, 2, "--votes", "1", "--group", "late")
    assert [finish(p)["results"] for p in early + [late]] == [[True], [True]]


def test_agreement_timeout_is_false_for_the_ranks_that_came(daemon):
    results = run_ranks(daemon, "agree", 3, "--votes", "1", "--group", "short", "--timeout", "1", ranks=[0, 1])
    assert [r["results"] for r in results] == [[False], [False]]
    assert "timed out after 1s waiting for rank(s) [2]" in daemon.logs()


def test_mismatched_nbytes_fails_every_rank(daemon):
    r0 = start_rank(daemon, "join", 0, 2, "--nbytes", "4096", "--group", "mm")
    wait_until(lambda: "rank=0" in daemon.logs(), 90, "rank 0 to join")
    r1 = start_rank(daemon, "join", 1, 2, "--nbytes", "8192", "--group", "mm")
    for r in (finish(r0), finish(r1)):
        assert not r["ok"] and r["type"] == "MonoUnsupported" and r["code"] == "MISMATCH", r
        assert "nbytes=8192 but rank 0 (pid" in r["message"] and "nbytes=4096" in r["message"]
    assert daemon.settled_segments() == []


def test_mismatched_npes_fails_every_rank(daemon):
    r0 = start_rank(daemon, "join", 0, 2, "--group", "mn")
    wait_until(lambda: "rank=0" in daemon.logs(), 90, "rank 0 to join")
    r1 = start_rank(daemon, "join", 1, 3, "--group", "mn")
    for r in (finish(r0), finish(r1)):
        assert not r["ok"] and r["code"] == "MISMATCH", r
        assert "npes=3 but rank 0 (pid" in r["message"] and "npes=2" in r["message"]


def refused_first_round(daemon, pages: bool, code: str, *wrong_args: str) -> list:
    """Two ranks hold a set and agree twice, rank 1's first call made with ``wrong_args``: it raises ``code``,
    and its no ends rank 0's round at once (rank 0 waited out the 30 s timeout, told rank 1 was absent);
    the next round finds both in step. Rank 1's first round, for the test to look at its message."""
    if not pages:
        daemon.stop()
        daemon.args = ("--control-pages", "false")
        daemon.start()
    procs = [start_rank(daemon, "agree_npes", r, 2, "--group", "refused", "--timeout", "30",
                        *(wrong_args if r == 1 else [])) for r in range(2)]
    first, wrong = (finish(p)["rounds"] for p in procs)
    assert wrong[0]["verdict"]["code"] == code, wrong
    assert first[0]["verdict"] is False and first[0]["seconds"] < 15, first
    assert first[1]["verdict"] is True and wrong[1]["verdict"] is True, (first, wrong)
    return wrong[0]


@pytest.mark.parametrize("pages", [True, False], ids=["page", "messages"])
def test_tp_agree_with_a_wrong_npes_fails_its_peers_round_at_once(daemon, pages):
    """Rank 1 calls tp_agree as one of 3 in a group of 2."""
    refused = refused_first_round(daemon, pages, "MISMATCH", "--agree-npes", "3")
    assert "npes=2" in refused["verdict"]["message"], refused
    if not pages:
        assert "rank 1: called tp_agree with npes=3, but the group has npes=2" in daemon.logs()


@pytest.mark.parametrize("pages", [True, False], ids=["page", "messages"])
@pytest.mark.parametrize("bad", ["0", "-1", "nan"])
def test_tp_agree_refused_for_its_timeout_still_votes_no_in_its_round(daemon, pages, bad):
    """Rank 1's first tp_agree passes an unusable timeout (a deadline already past, say); its call used to
    count as no round, and the ranks' answers went out of step."""
    refused = refused_first_round(daemon, pages, "BAD_REQUEST", "--first-timeout", bad)
    assert "timeout" in refused["verdict"]["message"], refused


def test_rendezvous_timeout_fails_every_waiting_rank_naming_the_missing(daemon):
    results = run_ranks(daemon, "join", 4, "--group", "lonely", "--timeout", "1", ranks=[0, 2])
    for r in results:
        assert not r["ok"] and r["code"] == "TIMEOUT", r
        assert "rank(s) [1, 3] of 4 never joined" in r["message"]
        assert "rank 0 (pid" in r["message"] and "rank 2 (pid" in r["message"]
    assert daemon.settled_segments() == []


def test_rank_out_of_range_and_rank_taken(daemon):
    out_of_range = run_ranks(daemon, "join", 2, "--group", "bad", ranks=[5])[0]
    assert out_of_range["code"] == "RANK_INVALID", out_of_range
    assert "rank 5 of group=bad is out of range for npes=2 (its ranks are 0 to 1)" in out_of_range["message"]
    holder = start_rank(daemon, "join", 0, 2, "--group", "taken", "--timeout", "120")
    wait_until(lambda: "group=taken name=default rank=0" in daemon.logs(), 90, "rank 0 to join")
    thief = run_ranks(daemon, "join", 2, "--group", "taken", ranks=[0])[0]
    assert thief["code"] == "RANK_TAKEN" and "already joined by pid" in thief["message"]
    holder.kill()
    holder.wait()


def test_several_named_buffer_sets_per_group_and_the_process_group_form(daemon, socket_dir):
    store = f"{socket_dir}/store"
    results = run_ranks(daemon, "process_group", 2, "--store", store)
    for r in results:
        assert r["ok"], r
        assert r["agreed"] is True
        assert r["seen"] == [1, 2, 100, 101]
    assert results[0]["key"] == results[1]["key"] and results[0]["key"].startswith("pg-")
    assert [r["rank"] for r in results] == [0, 1] and {r["npes"] for r in results} == {2}
    assert daemon.settled_segments() == []


def test_a_process_group_whose_rank_0_never_comes_is_peerds_timeout_and_a_false_round(daemon, socket_dir):
    """Rank 0 made the group but never calls peerd: its peer's PeerBuffer raises MonoUnsupported (TIMEOUT)
    naming rank 0, not torch's store error, and its tp_agree is False, as for any absent rank."""
    late, waiting = run_ranks(daemon, "process_group_without_rank_0", 2, "--store", f"{socket_dir}/store",
                              "--hold", "8", "--timeout", "3")
    assert late["ok"], late
    assert waiting["raised"]["code"] == "TIMEOUT", waiting
    assert "rank 0 of process group '0' did not give the group its peerd key within 3s" in \
        waiting["raised"]["message"], waiting
    assert waiting["agreed"] is False, waiting


def test_a_rank_that_contradicts_its_process_group_raises_and_its_peer_hears_at_once(daemon, socket_dir):
    """rank= against a process group raised ValueError on that rank alone: its peer waited out the
    rendezvous for a rank that never joined, then its whole agreement timeout for a vote never cast."""
    good, wrong = run_ranks(daemon, "process_group_contradicted", 2, "--store", f"{socket_dir}/store",
                            "--timeout", "30")
    assert good["ok"] and wrong["ok"], (good, wrong)
    assert wrong["buffer"]["value_error"], wrong
    assert "rank=0, npes=2 contradict the process group (rank 1 of 2)" in wrong["buffer"]["message"], wrong
    assert good["buffer"]["code"] == "GROUP_FAILED" and "contradict the process group" in good["buffer"]["message"]
    assert good["buffer_after_s"] < 10, "told at once, not at its 30 s rendezvous timeout"
    assert "contradict the process group" in wrong["agree_raised"], wrong
    assert good["agreed"] is False and good["agree_after_s"] < 10, "the round is False at once"
    assert daemon.settled_segments() == []


def test_a_lone_rank_that_contradicts_the_place_its_process_holds_is_told_to_the_peers(socket_dir):
    """The same, for a string key: a lone rank= against the place this process holds in the group. Without
    control pages, so that the second set's failure leaves the held set's rounds alone (on a page it
    aborts them): only the contradicting rank's no can make the round False at once."""
    daemon = Daemon(os.path.join(socket_dir, "peerd.sock"), Path(socket_dir) / "daemon.log",
                    args=("--control-pages", "false")).start()
    try:
        good, wrong = run_ranks(daemon, "string_key_contradicted", 2, "--group", "contradicted", "--timeout", "30")
    finally:
        assert daemon.stop() == 0, daemon.logs()
    assert good["ok"] and wrong["ok"], (good, wrong)
    assert wrong["buffer"]["value_error"], wrong
    assert "rank=0, npes=None contradict this process's place in group 'contradicted' (rank 1 of 2)" in \
        wrong["buffer"]["message"], wrong
    assert good["buffer"]["code"] == "GROUP_FAILED" and "contradict this process's place" in \
        good["buffer"]["message"] and good["buffer_after_s"] < 10, good
    assert "contradict this process's place" in wrong["agree_raised"], wrong
    assert good["agreed"] is False and good["agree_after_s"] < 10, "the round is False at once"


def test_a_released_set_can_be_joined_again(daemon):
    for attempt in range(2):
        results = run_ranks(daemon, "exchange", 2, "--group", "again")
        assert all(r["ok"] for r in results), results
    assert daemon.settled_segments() == []
