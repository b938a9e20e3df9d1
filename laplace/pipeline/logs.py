"""Logging for the command-line entry points: one format, and our lines not drowned by libraries'."""

from __future__ import annotations

import logging
import sys

# httpx logs every request at INFO; serve-check's readiness poll alone is hundreds of lines.
_CHATTY_AT_INFO = ("httpx", "httpcore")


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for name in _CHATTY_AT_INFO:
        logging.getLogger(name).setLevel(logging.WARNING)
