"""Byte counts as people read them (16.0 GiB), for messages and the CLI alike."""

from __future__ import annotations

UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def human(n: int | float) -> str:
    """``n`` bytes in the largest binary unit that keeps it at least 1: 512 B, 4.0 KiB, 1.0 PiB."""
    value = float(n)
    for unit in UNITS:
        if abs(value) < 1024 or unit == UNITS[-1]:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable: the last unit takes any size")
