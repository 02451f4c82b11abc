"""peerd.tally: refusals counted at once, logged in few lines however many there are."""

from __future__ import annotations

import logging

from peerd import tally
from peerd.logbudget import LogBudget
from peerd.tally import Tally


def test_the_first_few_of_an_interval_name_themselves_and_the_rest_are_counted_by_cause(caplog, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(tally.time, "monotonic", lambda: clock[0])
    refused = Tally(logging.getLogger("t"), "refused %d connection(s)", each=2)
    with caplog.at_level(logging.WARNING):
        for pid in range(1000):
            refused.add("uid 7", f"refused pid {pid}")
        clock[0] += tally.LOG_EVERY_S
        refused.flush()
    lines = [r.getMessage() for r in caplog.records]
    assert refused.total == 1000
    assert lines == ["refused pid 0", "refused pid 1", "refused 1 connection(s): uid 7", "refused 997 connection(s): uid 7"]


def test_the_log_budget_passes_its_lines_per_interval_then_counts_the_rest_in_one_line(caplog, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(tally.time, "monotonic", lambda: clock[0])  # the one time module both read
    budget = LogBudget(per_interval=2)
    caller_driven = logging.getLogger("peerd.rendezvous")
    caller_driven.addFilter(budget)
    try:
        with caplog.at_level(logging.INFO):
            for n in range(5):
                caller_driven.info("set %d failed", n)
            logging.getLogger("peerd.server").warning("the daemon's own line")  # never counted
            assert budget.due() == 100.0 + tally.LOG_EVERY_S
            clock[0] += tally.LOG_EVERY_S
            caller_driven.info("set 5 failed")  # the next interval: its count of the last goes out first
    finally:
        caller_driven.removeFilter(budget)
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "set 0 failed", "set 1 failed", "the daemon's own line",
        "3 log line(s) about sets and agreements not written in 10s", "set 5 failed"]
    assert budget.due() is None
