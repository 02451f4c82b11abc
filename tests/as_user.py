"""Run the peerd CLI as another user: `python tests/as_user.py UID:GID[:GIDS] serve ...`.

The interpreter's own files may be unreadable to that user (under /root), so
everything the daemon needs is imported first, then privileges are dropped.
"""

import os
import sys

import prometheus_client.core  # noqa: F401  (--metrics-port: imported by the daemon once it serves)
import prometheus_client.exposition  # noqa: F401

import peerd.access  # noqa: F401
import peerd.backends.host  # noqa: F401
import peerd.cli
import peerd.health  # noqa: F401
import peerd.lockfile  # noqa: F401
import peerd.metrics  # noqa: F401
import peerd.notify  # noqa: F401
import peerd.server  # noqa: F401
import peerd_client.connection  # noqa: F401

uid, gid, *extra = sys.argv[1].split(":")
os.setgroups([int(g) for g in extra[0].split(",")] if extra and extra[0] else [])
os.setgid(int(gid))
os.setuid(int(uid))
sys.argv = ["peerd", *sys.argv[2:]]
peerd.cli.main()
