"""Progress bars that read well both in a terminal and in a log.

In a terminal a tqdm bar redraws in place. Under DVC, Prefect or a stage worker its output is
a pipe, and every redraw becomes one more log line: a bar redrawn each step writes hundreds.
`progress_bar` keeps the live bar for a terminal and, for a pipe, redraws at most every
LOG_INTERVAL_S seconds (and once at the end), so a long probe logs tens of lines.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

from tqdm import tqdm

# A log line every 30 s is enough to see a stage is alive and how far it got. A display
# cadence, not a pipeline knob: it changes no result, so it is not in params.yaml.
LOG_INTERVAL_S = 30.0


def progress_bar(iterable: Iterable | None = None, *, enabled: bool = True, **kwargs) -> tqdm:
    """tqdm with `desc`, `unit`, `total`... as given; `enabled=False` draws nothing. Update the
    postfix with `set_postfix(..., refresh=False)`, or each update is a redraw."""
    if not sys.stderr.isatty():
        kwargs.setdefault("mininterval", LOG_INTERVAL_S)
    return tqdm(iterable, disable=not enabled, dynamic_ncols=True, **kwargs)
