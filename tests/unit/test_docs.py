"""The README and docs/ stay short enough to read and never point at nothing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_the_readme_stays_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    for target in LINK.findall(page.read_text()):
        if "://" in target:
            continue
        assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"


def test_the_shipped_unit_allows_every_address_family_the_daemon_opens():
    """The unit's RestrictAddressFamilies= left out AF_NETLINK, so under it the metrics port could not ask
    the kernel who owns a connection (sock_diag), and every scraper shared one share of 3 connections:
    any local user holding 3 blocked Prometheus. Every family the daemon's code opens must be allowed."""
    unit = (ROOT / "systemd" / "peerd.service").read_text()
    (allowed,) = re.findall(r"^RestrictAddressFamilies=(.*)$", unit, re.M)
    opened = {family for path in (ROOT / "peerd").rglob("*.py")
              for family in re.findall(r"socket\.(AF_[A-Z0-9]+)", path.read_text())}
    assert opened and opened <= set(allowed.split()), f"opened {sorted(opened)}, allowed {allowed}"
