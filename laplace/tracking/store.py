"""Reaching the MLflow tracking store: where it is, and waiting for it with bounded retries.

When the tracking server is down, `track` retries with backoff for `tracking.retry_seconds`,
then fails with one line (TrackingUnavailable, exit status 75: transient, so the Prefect flow
retries it); nothing is lost, since metrics/ and plots/ are the spool.
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path

from laplace.errors import Failure
from laplace.tracking.redact import redact

log = logging.getLogger(__name__)


def project_root(start: str | Path = ".") -> Path:
    """The project directory. Queued DVC experiments run in a copy under
    <project>/.dvc/tmp/exps/...; their tracking store is still the project's."""
    path = Path(start).resolve()
    parts = path.parts
    for i in range(len(parts) - 3):
        if parts[i : i + 3] == (".dvc", "tmp", "exps"):
            return Path(*parts[:i])
    return path


def tracking_store(root: str | Path = ".") -> tuple[str, str | None]:
    """(tracking URI, artifact location for new experiments).

    MLFLOW_TRACKING_URI if set (its server or default decides where artifacts go), else a
    sqlite database at an absolute path in the project with artifacts in mlartifacts/.
    Read this before mlflow.set_tracking_uri, which exports MLFLOW_TRACKING_URI itself."""
    if uri := os.environ.get("MLFLOW_TRACKING_URI"):
        return uri, None
    root = project_root(root)
    return f"sqlite:///{root / 'mlflow.db'}", (root / "mlartifacts").as_uri()


def tracking_uri(root: str | Path = ".") -> str:
    return tracking_store(root)[0]


class TrackingUnavailable(Failure):
    """The tracking server did not answer within tracking.retry_seconds. Transient: the CLI
    exits with `exit_status` (75, EX_TEMPFAIL), which the Prefect flow retries; the stage
    results stay on disk and a rerun of the track stage logs them."""

    exit_status = 75


_MAX_BACKOFF_S = 10.0


def _is_http(uri: str) -> bool:
    return uri.lower().startswith(("http://", "https://"))


def unavailable_message(uri: str, reason: str, retry_seconds: float, during: str = "") -> str:
    what = "server" if _is_http(uri) else "store"
    return (
        f"MLflow tracking {what} {redact(uri)} unreachable{during} ({reason}; retried for "
        f"{retry_seconds:g}s, tracking.retry_seconds): nothing was lost, the stage results stay in "
        "metrics/ and plots/; rerun `laplace track` (or `dvc repro`) once it is back to log them"
    )


def _short_reason(exc: BaseException) -> str:
    """One short line for a connection failure ("Connection refused", "timed out", ...)."""
    text = " ".join(str(exc).split())
    if found := re.search(r"\[Errno -?\d+\] ([^'\")\]]+)", text):
        return found.group(1).strip().rstrip(".")
    if "timed out" in text.lower() or "timeout" in type(exc).__name__.lower():
        return "timed out"
    return redact(text[:160]) or type(exc).__name__


def _probe(uri: str, timeout: float) -> str | None:
    """None when the tracking server answers, else why not. Stores that are not HTTP servers
    (sqlite, file) are not probed here: their first call is retried instead."""
    if not _is_http(uri):
        return None
    import requests

    insecure = os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() in ("1", "true")
    verify = False if insecure else os.environ.get("MLFLOW_TRACKING_SERVER_CERT_PATH") or True
    try:  # one plain request, no urllib3 retries: MLflow's own client would retry for minutes
        response = requests.get(uri.rstrip("/") + "/health", timeout=timeout, verify=verify, allow_redirects=False)
    except requests.RequestException as exc:
        return _short_reason(exc)
    return None if response.status_code < 500 else f"HTTP {response.status_code}"


def wait_for_tracking(uri: str, retry_seconds: float) -> float:
    """Block until the tracking server answers, probing with backoff (0.5 s, 1 s, 2 s, ...
    at most 10 s apart) for at most `retry_seconds`. Returns the deadline (time.monotonic)
    for the retries that follow; raises TrackingUnavailable when the time is up."""
    deadline = time.monotonic() + retry_seconds
    delay, warned = 0.5, False
    while True:
        reason = _probe(uri, timeout=min(5.0, max(0.5, deadline - time.monotonic())))
        if reason is None:
            if warned:
                log.info("MLflow tracking server %s is back", redact(uri))
            return deadline
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TrackingUnavailable(unavailable_message(uri, reason, retry_seconds))
        if not warned:
            log.warning(
                "MLflow tracking server %s unreachable (%s); retrying for up to %gs (tracking.retry_seconds)",
                redact(uri),
                reason,
                retry_seconds,
            )
            warned = True
        time.sleep(min(delay, remaining))
        delay = min(2 * delay, _MAX_BACKOFF_S)


def _transient(exc: BaseException) -> bool:
    """A failure worth retrying: the server unreachable or erroring, the sqlite store locked."""
    return _connection_lost(exc) or "locked" in str(exc).lower() or type(exc).__name__ == "OperationalError"


def _retrying(fn, uri: str, deadline: float, retry_seconds: float):
    """fn() retried with backoff until `deadline` (a sqlite store may be locked, a server restarting).
    Any other failure (a permission denied, say) is one line at once: retrying cannot help."""
    delay = 0.5
    while True:
        try:
            return fn()
        except Exception as exc:
            if not _transient(exc):
                raise RuntimeError(
                    f"MLflow tracking store {redact(uri)} refused the request: "
                    f"{redact(' '.join(str(exc).split()))[:300]}"
                ) from exc
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TrackingUnavailable(unavailable_message(uri, _short_reason(exc), retry_seconds)) from exc
            log.warning(
                "MLflow tracking store %s failed (%s); retrying in %.1fs",
                redact(uri),
                _short_reason(exc),
                min(delay, remaining),
            )
            time.sleep(min(delay, remaining))
            delay = min(2 * delay, _MAX_BACKOFF_S)


def _connection_lost(exc: BaseException) -> bool:
    """True when `exc` (or what caused it) says the server could not be reached."""
    import requests

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (requests.ConnectionError, requests.Timeout, ConnectionError)):
            return True
        if any(s in str(exc) for s in ("Max retries exceeded", "Connection refused", "Failed to establish")):
            return True
        exc = exc.__cause__ or exc.__context__
    return False
