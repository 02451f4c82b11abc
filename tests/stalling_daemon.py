"""Run a command (``python -m peerd serve ...``) whose daemon loop stalls while the file
$PEERD_TEST_STALL_FILE exists, as a loop stuck in a hung driver call does: its ZeroMQ I/O
thread still answers heartbeats, so the workers' connections stay up and unanswered."""

from __future__ import annotations

import os
import runpy
import sys
import time

import peerd.server


def main() -> None:
    flag, turn = os.environ["PEERD_TEST_STALL_FILE"], peerd.server.Daemon._turn

    def stalling_turn(self, events):
        while os.path.exists(flag):
            time.sleep(0.05)
        return turn(self, events)

    peerd.server.Daemon._turn = stalling_turn
    _python, dash_m, module, *args = sys.argv[1:]
    assert dash_m == "-m", sys.argv
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
