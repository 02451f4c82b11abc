"""Starting peerd's own Python children: the job's daemon (`peerd run`) and the selftest's workers.

`python -m X` puts the current directory first on sys.path, so started from a
directory another user can write (/tmp, /dev/shm), a planted
``peerd/__main__.py`` would run as the caller, root included. The children
start in ``/`` with PYTHONSAFEPATH set (Python 3.11 on: no current directory
on their path at all), and find peerd where this process found it: the
folders it imported ``peerd`` and ``peerd_client`` from lead their
PYTHONPATH, so a checkout run without installing still works.
"""

from __future__ import annotations

import os
import sys

#: where the children start: a directory only root can write
CHILD_CWD = "/"


def python_child(module: str, *args: str, env: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The argv and environment that run ``python -m module args`` with this process's peerd and
    nothing from the current directory; start it with ``cwd=CHILD_CWD``."""
    import peerd
    import peerd_client

    env = dict(os.environ if env is None else env)
    roots = [os.path.dirname(os.path.dirname(os.path.abspath(m.__file__))) for m in (peerd, peerd_client)]
    inherited = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([*roots, *inherited]))
    env["PYTHONSAFEPATH"] = "1"
    return [sys.executable, "-m", module, *args], env
