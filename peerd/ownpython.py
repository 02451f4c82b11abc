"""Starting peerd's own Python children: the job's daemon (`peerd run`) and the selftest's workers.

`python -m X` puts the current directory first on sys.path, so started from a
directory another user can write (/tmp, /dev/shm), a planted
``peerd/__main__.py`` would run as the caller, root included. The children
start in ``/`` with PYTHONSAFEPATH set (Python 3.11 on: no current directory
on their path at all), and find peerd as this process did: through the same
interpreter, environment and installed paths, and where this process found
it only in its own first path entry (a checkout run with `python -m peerd`
without installing), through that folder put on their PYTHONPATH. Nothing
else is put there: an installed peerd's site-packages ahead of the standard
library would let a stale backport there shadow it.
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
    first = os.path.abspath(sys.path[0] or os.curdir)  # the script's folder, or the current one (-m, -c)
    roots = {os.path.dirname(os.path.dirname(os.path.abspath(m.__file__))) for m in (peerd, peerd_client)}
    inherited = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]  # as meant here
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([*sorted(roots & {first}), *inherited]))
    env["PYTHONSAFEPATH"] = "1"
    return [sys.executable, "-m", module, *args], env
