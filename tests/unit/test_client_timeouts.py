"""PEERD_CONNECT_TIMEOUT and PEERD_REQUEST_TIMEOUT: a bad value is warned about and the default used."""

from __future__ import annotations

import subprocess
import sys

import pytest

IMPORT = "import peerd_client, peerd_client.connection as c; print(c.CONNECT_TIMEOUT_S, c.REQUEST_TIMEOUT_S)"


def import_with(**env: str) -> subprocess.CompletedProcess:
    """Import peerd_client in a fresh interpreter, as every worker does, with ``env`` set."""
    clean = {"PATH": "/usr/bin:/bin", **env}
    return subprocess.run([sys.executable, "-c", IMPORT], env=clean, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("value", ["abc", "-1", "0", "nan", "inf", "100000", ""])
def test_a_bad_timeout_warns_once_naming_the_variable_and_uses_the_default(value):
    """PEERD_CONNECT_TIMEOUT=abc made `import peerd_client` raise in every worker; -1 meant wait forever."""
    done = import_with(PEERD_CONNECT_TIMEOUT=value, PEERD_REQUEST_TIMEOUT=value)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["5.0", "10.0"]
    for name, default in (("PEERD_CONNECT_TIMEOUT", "5"), ("PEERD_REQUEST_TIMEOUT", "10")):
        (line,) = [line for line in done.stderr.splitlines() if name in line]
        assert repr(value) in line and "86400" in line and f"default {default}" in line


def test_a_good_timeout_is_taken_without_a_word():
    done = import_with(PEERD_CONNECT_TIMEOUT=" 2.5 ", PEERD_REQUEST_TIMEOUT="86400")
    assert done.returncode == 0 and done.stderr == ""
    assert done.stdout.split() == ["2.5", "86400.0"]
