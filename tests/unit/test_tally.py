"""peerd.tally: refusals counted at once, logged in few lines however many there are."""

from __future__ import annotations

import logging

from peerd import tally
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
