"""The headline figures of the last pipeline run, read from the metrics on disk, as rows of
(topic, lines). One renderer for every front door: `as_text` for the CLI (`laplace run`,
`laplace summary`), `as_markdown` for the Prefect flow's artifact, `stage_line` for the one
line each stage command ends with.

Figures a stage did not measure in this pipeline run (DVC skipped it as up to date, or
restored it from its run-cache) are marked with the run they were measured in."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from laplace.pipeline.layout import Paths
from laplace.pipeline.stages import STAGES


def read(paths: Paths) -> dict:
    """Each stage's metrics (empty when absent) and the tracking record, keyed by metrics name."""

    def load(p: Path) -> dict:
        return json.loads(p.read_text()) if p.exists() else {}

    info = {stage.metrics: load(paths.metrics_file(stage.metrics)) for stage in STAGES.values() if stage.metrics}
    info["tracking"] = load(paths.tracking_file)
    return info


def _verdict(passed: bool) -> str:
    return "passed" if passed else "MISSED"


def rows(info: dict, root: Path) -> list[tuple[str, list[str]]]:
    """(topic, lines) for every stage that has results, in pipeline order."""
    from laplace.tracking.provenance import source_text

    out: list[tuple[str, list[str]]] = []
    sources = (info.get("tracking") or {}).get("sources") or {}
    for stage, topic, lines_of in STAGE_ROWS:
        if figures := info.get(stage):
            lines = lines_of(figures, root)
            if sources.get(stage) is not None:  # measured in an earlier run: say which
                lines = lines + [source_text(sources[stage])]
            out.append((topic, lines))
    if trk := info.get("tracking"):
        out.append(("mlflow", _mlflow_lines(trk)))
    return out


def _corpus_lines(tok: dict, root: Path) -> list[str]:
    return [
        f"{tok['documents_train'] + tok['documents_val']:,} documents, "
        f"{tok['tokens_train']:,} train / {tok['tokens_val']:,} val tokens"
    ]


def _training_lines(tr: dict, root: Path) -> list[str]:
    return [
        f"{tr['steps']} steps, val loss {tr['val_loss_initial']:.3f} -> {tr['val_loss']:.3f} "
        f"(ppl {tr['val_ppl']:.1f}), {tr['tokens_per_s'] or 0:,.0f} tokens/s"
    ]


def _model_lines(ex: dict, root: Path) -> list[str]:
    return [f"{root / ex['export_dir']} ({ex['parameters']:,} parameters)"]


def _warmup_lines(wu: dict, root: Path) -> list[str]:
    return [
        f"{wu['graphs']} graphs compiled in {wu['compile_seconds_total']:.1f}s cold, "
        f"{wu['warm_start_seconds_total']:.1f}s warm ({wu['warm_speedup']:.1f}x)"
        + (
            f", warm start loaded from cache {wu['warm_loaded_from_cache']}/{wu['graphs']}"
            if wu.get("warm_loaded_from_cache") is not None
            else ""
        )
        + (  # process trees in CPU-seconds: the load-robust measure (runs before it had none)
            f"; {wu['warm_cpu_s']:.1f} of {wu['cold_cpu_s']:.1f} CPU-s ({wu['warm_cpu_fraction']:.1%})"
            if wu.get("warm_cpu_fraction") is not None
            else ""
        )
    ]


def _serving_lines(sv: dict, root: Path) -> list[str]:
    exact, padded = sv["exact"], sv["padded"]
    ratio_key = next(k for k in sv if k.startswith("decode_cost_ratio_"))
    return (
        [
            f"{sv['headline_workload']}: padded {padded['output_tokens_per_s']:.0f} tokens/s, "
            f"{padded['compile_events']} compiles, TTFT p99 {padded['ttft_p99_s']:.3f}s | exact "
            f"{exact['output_tokens_per_s']:.0f} tokens/s, "
            f"compiles {exact['compile_step_share']:.1%} of steps, "
            f"{exact['compile_time_share']:.1%} of decode time",
            f"{ratio_key} = {sv[ratio_key]:.3f}; gates {_verdict(sv['passed'])}",
        ]
        + _prefix_cache_line(sv)
        + _live_line(sv)
    )


def _numerics_lines(nm: dict, root: Path) -> list[str]:
    figures = []
    if f32 := nm.get("fp32"):
        figures.append(
            f"fp32 compiled vs fp64 rel RMS {f32['prefill']['rel_rms_compiled_vs_fp64']:.1e}, "
            f"max |compiled-eager| {nm['max_abs_logit_diff_fp32']:.1e}"
        )
    if b16 := nm.get("bf16"):
        figures.append(
            f"bf16 compiled {b16['prefill']['rel_rms_compiled_vs_fp64']:.1e} vs eager "
            f"{b16['prefill']['rel_rms_eager_vs_fp64']:.1e}"
        )
    return ["; ".join(figures) + f"; gates {_verdict(nm['passed'])}"]


def _probes_lines(pr: dict, root: Path) -> list[str]:
    lines = []
    if grid := pr.get("mqar_trained_accuracy") or {}:
        ctx = sorted(grid, key=int)
        easy, hard = grid[ctx[0]], grid[ctx[-1]]
        lines.append(
            f"MQAR-trained GLA: {max(easy.values()):.0%} at {ctx[0]} tokens, "
            f"{min(hard.values()):.0%} at {ctx[-1]} "
            "(a small GLA trained here on MQAR: what a model that learned the task scores)"
        )
    if "mqar_accuracy" in pr:
        lines.append(
            f"exported model: MQAR {max(pr['mqar_accuracy'].values()):.0%}, passkey "
            f"{pr['passkey_accuracy_overall']:.0%} (reported, not gated: a model this small and briefly "
            "trained does not retrieve yet)"
        )
    if pr.get("recall_summary"):
        per_length = "; ".join(
            f"{c}: {v.removeprefix('recall: ')}"  # the line already starts with "recall:"
            for c, v in sorted(pr["recall_verdict"].items(), key=lambda kv: int(kv[0]))
        )
        lines.append(f"{pr['recall_summary']} ({per_length})")
    if pr.get("kv_bytes_measured"):  # a hybrid or softmax model: its slots' K/V beside the state
        lines.append(
            f"held per sequence: state {pr['state_bytes_measured']:,} B + attention K/V "
            f"{pr['kv_bytes_measured']:,} B (up to engine.max_context)"
        )
    lines.append(
        f"state {pr['state_bytes_measured']:,} B/sequence vs KV@8192 {pr['kv_bytes_8192']:,} B; "
        f"3B: {pr['laplace_3b_state_bytes'] / 1e6:.1f} MB vs {pr['laplace_3b_kv_bytes_8192'] / 1e9:.2f} GB "
        f"({pr['laplace_3b_state_vs_kv_8192']:.1f}x); gates {_verdict(pr['passed'])} "
        "(serving and eager paths agree, state as computed)"
    )
    return lines


def _mlflow_lines(trk: dict) -> list[str]:
    lines = [f"run {trk['run_id']} in {trk['tracking_uri']}"]
    if trk.get("model_version"):
        alias = "champion" if trk.get("champion") else "candidate"
        lines.append(f"registered {trk['model_name']} v{trk['model_version']} as {alias}")
        if trk.get("registered_reason"):
            lines[-1] += f": {trk['registered_reason']}"
    return lines


# (a stage's metrics name, its topic in the summary, its lines from its figures and the project
# root), in the order the summary shows them; the tracking record's row (mlflow) comes after them
STAGE_ROWS = (
    ("tokenize", "corpus", _corpus_lines),
    ("train", "training", _training_lines),
    ("export", "model", _model_lines),
    ("warmup", "warmup", _warmup_lines),
    ("serve-check", "serving", _serving_lines),
    ("numerics", "numerics", _numerics_lines),
    ("probes", "probes", _probes_lines),
)


def _prefix_cache_line(sv: dict) -> list[str]:
    pc = sv.get("prefix_cache") or {}
    if "on" not in pc:
        return []
    on, off = pc["on"], pc["off"]
    return [
        f"shared_prefix: TTFT p50 {on['ttft_p50_s']:.4f}s with the prefix cache vs {off['ttft_p50_s']:.4f}s "
        f"without, p99 {on['ttft_p99_s']:.4f}s vs {off['ttft_p99_s']:.4f}s ({on['hits']} hits, "
        f"{on['misses']} misses, identical outputs {pc['identical_outputs_share']:.0%}); {ttft_verdict(on, off)}"
    ]


def ttft_verdict(on: dict, off: dict) -> str:
    """Whether one replay with the cache and one without tell their TTFTs apart. Each side is a
    single replay, so the only noise measure is the spread of TTFTs within a replay (p50 to p99):
    a gap between the p50s smaller than both replays' spread is within noise."""
    gap = on["ttft_p50_s"] - off["ttft_p50_s"]
    spread = min(on["ttft_p99_s"] - on["ttft_p50_s"], off["ttft_p99_s"] - off["ttft_p50_s"])
    if abs(gap) <= spread:
        return f"within noise: the p50s differ by {abs(gap):.4f}s, less than either replay's p50-to-p99 spread"
    faster = "faster" if gap < 0 else "slower"
    return f"{faster} with the cache by {abs(gap):.4f}s at p50, more than either replay's p50-to-p99 spread"


def _live_line(sv: dict) -> list[str]:
    live, ratio = sv.get("live"), sv.get("live_vs_replay") or {}
    if not live:
        return []
    warm = ""
    if live.get("warmup_graphs"):
        warm = (
            f", ready in {live.get('server_startup_s') or live['server_ready_s']:.1f}s, loaded from cache "
            f"{live.get('warmup_graphs_from_cache', 0):.0f}/{live['warmup_graphs']:.0f}"
        )
    return [
        f"live laplace serve: {live['output_tokens_per_s']:.0f} tokens/s "
        f"({ratio.get('output_tokens_per_s', 0):.2f}x the replay), TTFT p99 {live['ttft_p99_s'] or 0:.3f}s "
        f"({ratio.get('ttft_p99_s', 0):.2f}x), {live['compile_events']:.0f} compiles, "
        f"{live['served']}/{live['requests']} served" + warm
    ]


def stage_line(stage_metrics: str | None, result: dict, root: Path) -> str:
    """The one line a stage command ends with: its row of the summary (`stage_metrics` is the
    stage's metrics name, None for track)."""
    try:
        found = rows({stage_metrics or "tracking": result}, root)
    except (KeyError, TypeError, ValueError, StopIteration):  # figures the row does not expect
        found = []  # the line is a courtesy: it must never fail a stage that succeeded
    return "; ".join(line for _, lines in found for line in lines) if found else "done"


def next_steps(root: Path, info: dict | None = None) -> list[str]:
    """What to try next, as lines that run as printed in a fresh shell, after the first line
    (the project directory and the venv that ran this, README's .venv); a line starting with
    # is a note. Servers run in the background (`&`, or a terminal of their own)."""
    trk = (info or {}).get("tracking") or {}
    in_venv = sys.prefix != sys.base_prefix
    first = f"cd {root}" + (f" && source {Path(sys.prefix)}/bin/activate" if in_venv else "")
    lines = [
        f"{first}   # first, in every new terminal",
        'git add -A && git commit -qm "baseline run"   # the baseline: dvc metrics diff compares with it',
        "dvc exp run --set-param train.lr=1e-3 && dvc metrics diff   # an experiment vs the baseline",
        "dvc exp show --only-changed --drop 'Created|laplace|.*/.*'   # the runs side by side (docs/pipeline.md)",
        "dvc plots show   # then open dvc_plots/index.html",
    ]
    if not trk.get("tracking_uri", "").startswith("http"):  # a tracking server serves its own UI
        lines.append("make mlflow-ui &   # the MLflow UI on 127.0.0.1:5000, in the background")
    if trk.get("ui_url"):
        lines.append(f"# then browse {trk['ui_url']}")
    return lines + [
        "make prefect-server &   # a local Prefect server on 127.0.0.1:4200 (or in a terminal of its own)",
        "make prefect-worker &   # once the server answers: the work pool, the deployments, a worker",
        "export PREFECT_API_URL=http://127.0.0.1:4200/api && make prefect-ready"
        " && prefect deployment run 'laplace-pipeline/tiny' --watch",
        "make stop   # stop the MLflow UI, the Prefect server, the worker and its flow runs",
    ]


def status_lines(info: dict) -> list[str]:
    """Nothing for a finished, tracked run; else what is missing, so that the next steps of an
    unfinished or untracked run are not read as those of a finished one."""
    missing = [stage.metrics for stage in STAGES.values() if stage.metrics and not info.get(stage.metrics)]
    out = []
    if missing:
        out.append(
            f"UNFINISHED: no results yet from {', '.join(missing)} (the run stopped, or is still running); "
            "`laplace run` finishes it (it resumes)"
        )
    if not info.get("tracking"):
        out.append("nothing is tracked in MLflow yet (the track stage has not run): no runs, no registered model")
    return out


def as_text(info: dict, root: Path) -> str:
    lines = ["", "=== Laplace pipeline ==="]
    status = status_lines(info)
    for topic, texts in (
        ([("status", status)] if status else []) + rows(info, root) + [("next", next_steps(root, info))]
    ):
        for i, text in enumerate(texts):
            lines.append(f"{topic if i == 0 else '':<12}{text}")
    return "\n".join(lines)


def as_markdown(info: dict, root: Path) -> str:
    table = "\n".join(
        f"| {topic} | {'<br>'.join(t.replace('|', '/') for t in texts)} |" for topic, texts in rows(info, root)
    )
    return f"# Laplace pipeline\n\n| stage | figures |\n|---|---|\n{table}\n"
