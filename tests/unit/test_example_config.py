"""systemd/peerd.toml, the example an operator copies, against the options peerd serve has."""

from __future__ import annotations

import re
from pathlib import Path

from peerd.settings import OPTIONS, Loader

EXAMPLE = Path(__file__).resolve().parents[2] / "systemd" / "peerd.toml"


def test_the_example_shows_every_option_with_a_value_the_daemon_takes(tmp_path):
    """Every commented-out default, uncommented, loads: each key known, each value valid, none missing
    (six options added since had gone unlisted while the check ran only by hand)."""
    uncommented = tmp_path / "all.toml"
    text = re.sub(r"(?m)^# ([a-z_]+ = )", r"\1", EXAMPLE.read_text())
    # the group the service's sysusers file makes, which this machine may lack: a group it has stands in
    uncommented.write_text(text.replace('socket_group = "peerd"', 'socket_group = "root"'))
    nothing_given = {o.name: (() if o.multiple else None) for o in OPTIONS}
    _, sources = Loader(nothing_given, str(uncommented)).load()
    assert [name for name, source in sources.items() if source == "default"] == []
