"""Every script under examples/ runs as the README says, under `peerd run`, and exits 0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parents[2] / "examples"

RUNS = {
    "two_ranks.py": ([sys.executable, str(EXAMPLES / "two_ranks.py")],
                     ["rank 0: peer 1's buffer reads 2", "rank 1: agreement with rank 0 voting False -> False"]),
    "torchrun_worker.py": ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                            str(EXAMPLES / "torchrun_worker.py")],
                           ["rank 0/2: addresses of every rank's buffer", "rank 1/2: addresses"]),
}


def test_every_example_is_exercised():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(RUNS)


@pytest.mark.parametrize("script", sorted(RUNS))
def test_example_runs_under_peerd_run(script):
    command, expected = RUNS[script]
    result = subprocess.run([sys.executable, "-m", "peerd", "run", "--log-level", "warning", "--", *command],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, f"{script} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    for line in expected:
        assert line in result.stdout, f"{script} did not print {line!r}:\n{result.stdout}"
