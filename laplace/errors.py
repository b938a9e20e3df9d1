"""Errors with a meaning for every front door.

An `InputError` means "your input or a gate is wrong": exit status 2, which the Prefect
flow never retries. Library modules raise subclasses that name the file, field or knob at
fault. Anything else is a crash (exit status 1, or the signal that killed a worker) and is
retried; a `Failure` is a crash we can explain in one line (a full disk, a killed worker,
an unreachable tracking server): one line instead of a traceback, with its own exit status.
"""

from __future__ import annotations

# Exit status of `laplace <command>` (and of a stage worker) for an InputError.
INPUT_ERROR_EXIT = 2


class InputError(ValueError):
    """Bad input (params, data, a model directory) or a missed gate; the message is one line."""


class Failure(RuntimeError):
    """A failure that is not the input's fault (a crashed worker, a full disk, a server down):
    reported in one line with a status other than 2, so the Prefect flow retries it."""

    exit_status = 1


class ConfigError(InputError):
    """A bad configuration value; the message names the offending key."""


class GateFailed(InputError):
    """A validation gate (serve-check, numerics, probes) was missed; its metrics are written first."""


class PeerInputError(InputError):
    """Another rank of a distributed job rejected its input; that rank's own error says why."""


class DataError(InputError):
    """Bad data input; the one-line message names the file, field or knob at fault."""


def one_line(exc: BaseException) -> str:
    """`Type: first line of the message`, for wrapping a library's error into one of ours."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
