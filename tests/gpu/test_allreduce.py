"""The all-reduce kernel on a real GPU: worker processes sharing it, a cuda daemon.

Processes sharing one GPU are time-sliced, so this proves the mappings and
the protocol, not the speed (bench/allreduce.py, docs/allreduce.md).
"""

from __future__ import annotations

import pytest

from tests.allreduce_rank import start
from tests.conftest import finish
from tests.gpu.test_cuda import REASON, cuda_daemon  # noqa: F401 (the fixture)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=REASON or "")]


@pytest.mark.parametrize("npes", [2, 4, 8])
def test_eager_calls_and_graph_replays_match_the_plain_sum(cuda_daemon, npes):  # noqa: F811
    calls, replays = 48, 16
    procs = start(cuda_daemon, npes, "--group", f"gpu-ar{npes}", "--device", "cuda:0", "--nbytes", str(1 << 20),
                  "--calls", str(calls), "--replays", str(replays))
    results = [finish(p, timeout=120) for p in procs]
    print(f"{npes} ranks: {calls + replays + 2} calls in {max(r.get('seconds', 0) for r in results):.2f}s")
    for r in results:
        assert r["ok"], r
        assert r["failures"] == [], r["failures"]
        assert r["calls"] == r["epoch"] == calls + replays + 2, "every replay advances the device epoch"
