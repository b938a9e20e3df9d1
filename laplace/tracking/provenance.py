"""Provenance of a pipeline run: the git commit, the hashes DVC recorded, and where each stage's
figures came from (measured in this run, or cached from the run that measured them)."""

from __future__ import annotations

import subprocess
from datetime import datetime
from pathlib import Path

import yaml


def git_info(root: Path) -> dict:
    def git(*args):
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
        return out.stdout.strip() if out.returncode == 0 else ""

    commit = git("rev-parse", "HEAD")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    return {"commit": commit or "unknown", "dirty": dirty}


def dvc_out_hash(root: Path, out_path: str) -> str | None:
    """The md5 DVC recorded in dvc.lock for one output (a directory hash ends in .dir)."""
    lock = Path(root) / "dvc.lock"
    if not lock.exists():
        return None
    data = yaml.safe_load(lock.read_text()) or {}
    for stage in (data.get("stages") or {}).values():
        for out in stage.get("outs") or []:
            if out.get("path") == out_path:
                return out.get("md5") or out.get("hash")
    return None


# --------------------------------------------------------------------------- where figures came from


def _utc(iso: str | None) -> str:
    """'2026-11-30T16:52:43Z' -> '2026-11-30 16:52 UTC' (as given when it does not parse)."""
    try:
        return datetime.fromisoformat(str(iso).replace("Z", "+00:00")).strftime("%Y-%m-%d %H:%M UTC")
    except ValueError:
        return str(iso)


def _epoch(iso: str | None) -> float | None:
    try:
        return datetime.fromisoformat(str(iso).replace("Z", "+00:00")).timestamp()
    except (TypeError, ValueError):
        return None


def measurement_sources(client, experiment_id: str, metrics_by_stage: dict[str, dict]) -> dict[str, dict | None]:
    """For each stage, None when its figures were measured in this pipeline run, else where they
    came from (`run_id`, `run_name`, `measured_at`). A stage DVC did not run this time (up to
    date, or restored from its run-cache) keeps the stamp of the run that measured it:

    - the finished MLflow run that first logged that stamp (in its tag `measured`), or
    - when no run logged it (that pipeline run's track never succeeded, or logged elsewhere)
      but it finished before the experiment's last finished run ended, an earlier pipeline
      run all the same (`run_id` None, `measured_at` set);

    a stage without a stamp (written by an older version) is reported as such."""
    latest = client.search_runs(
        [experiment_id], "attributes.status = 'FINISHED'", order_by=["attributes.end_time DESC"], max_results=1
    )
    last_end = latest[0].info.end_time / 1000 if latest and latest[0].info.end_time else None
    sources: dict[str, dict | None] = {}
    for stage, metrics in sorted(metrics_by_stage.items()):
        stamp = metrics.get("measured") if isinstance(metrics.get("measured"), dict) else None
        if not stamp or not stamp.get("id"):
            sources[stage] = {"run_id": None, "run_name": None, "measured_at": None}
            continue
        earlier = client.search_runs(
            [experiment_id],
            filter_string=f"tags.measured LIKE '%{stage}={stamp['id']}%' and attributes.status = 'FINISHED'",
            order_by=["attributes.start_time ASC"],
            max_results=1,
        )
        finished = _epoch(stamp.get("finished"))
        if earlier:
            info = earlier[0].info
            sources[stage] = {"run_id": info.run_id, "run_name": info.run_name, "measured_at": stamp.get("started")}
        elif last_end is not None and finished is not None and finished + 1 < last_end:  # stamps keep whole seconds
            sources[stage] = {"run_id": None, "run_name": None, "measured_at": stamp.get("started")}
        else:
            sources[stage] = None
    return sources


def measured_tag(metrics_by_stage: dict[str, dict]) -> str:
    """The run's one `measured` tag: `stage=stamp-id` for every stage's measurement stamp, by which
    a later run finds the run that measured figures it reuses (measurement_sources)."""
    return " ".join(
        f"{stage}={m['measured']['id']}"
        for stage, m in sorted(metrics_by_stage.items())
        if isinstance(m.get("measured"), dict) and m["measured"].get("id")
    )


def source_text(source: dict | None) -> str:
    """How a person reads where a stage's figures came from."""
    if source is None:
        return "measured in this run"
    if source.get("run_id") is None:
        if source.get("measured_at"):
            return f"cached from an earlier pipeline run not in MLflow, measured {_utc(source['measured_at'])}"
        return "from an earlier run (no measurement stamp)"
    return f"cached from run {source['run_name']} ({source['run_id'][:8]}), measured {_utc(source['measured_at'])}"


def pipeline_started(metrics_by_stage: dict[str, dict], sources: dict[str, dict | None], fallback: float) -> float:
    """When this pipeline run began: the start of the earliest stage measured in it."""
    starts = [
        _epoch((m.get("measured") or {}).get("started"))
        for stage, m in metrics_by_stage.items()
        if sources.get(stage) is None and isinstance(m.get("measured"), dict)
    ]
    return min([s for s in starts if s is not None] + [fallback])
