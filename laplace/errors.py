"""The errors that mean "your input or a gate is wrong": never worth a retry.

Every front door maps an `InputError` to exit status 2 (the Prefect flow does not retry
it); anything else is a crash (exit status 1, or the signal that killed a worker) and is
retried. Library modules raise subclasses that name the file, field or knob at fault.
"""

from __future__ import annotations

# Exit status of `laplace <command>` (and of a stage worker) for an InputError.
INPUT_ERROR_EXIT = 2


class InputError(ValueError):
    """Bad input (params, data, a model directory) or a missed gate; the message is one line."""


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
