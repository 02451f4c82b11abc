"""Escaping what users wrote before it reaches a log line or a terminal.

Group keys and names are refused when they hold control characters, but
commit reasons are free text, and a daemon message quotes whatever the client
sent: a newline would forge a log line, an escape sequence would drive the
operator's terminal. One helper, used for every log line and every line the
CLI prints.
"""

from __future__ import annotations

import logging


def escape(text: str) -> str:
    """``text`` with every non-printable character written as its Python escape (\\n, \\x1b, \\u2028)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


class EscapingFormatter(logging.Formatter):
    """A Formatter whose message part is escaped, so one record is always one line."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escape(record.message)
        return super().formatMessage(record)
