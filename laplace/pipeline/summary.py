"""The headline figures of the last pipeline run, read from the metrics on disk, as rows of
(topic, lines). One renderer for every front door: `as_text` for the CLI (`laplace run`,
`laplace summary`), `as_markdown` for the Prefect flow's artifact, `stage_line` for the one
line each stage command ends with.

Figures a stage did not measure in this pipeline run (DVC skipped it as up to date, or
restored it from its run-cache) are marked with the run they were measured in."""

from __future__ import annotations

import json
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
    from laplace.pipeline.provenance import source_text

    out: list[tuple[str, list[str]]] = []
    sources = (info.get("tracking") or {}).get("sources") or {}

    def add(stage: str, topic: str, lines: list[str]) -> None:
        if sources.get(stage) is not None:  # measured in an earlier run: say which
            lines = lines + [source_text(sources[stage])]
        out.append((topic, lines))

    if tok := info.get("tokenize"):
        add(
            "tokenize",
            "corpus",
            [
                f"{tok['documents_train'] + tok['documents_val']:,} documents, "
                f"{tok['tokens_train']:,} train / {tok['tokens_val']:,} val tokens"
            ],
        )
    if tr := info.get("train"):
        add(
            "train",
            "training",
            [
                f"{tr['steps']} steps, val loss {tr['val_loss_initial']:.3f} -> {tr['val_loss']:.3f} "
                f"(ppl {tr['val_ppl']:.1f}), {tr['tokens_per_s'] or 0:,.0f} tokens/s"
            ],
        )
    if ex := info.get("export"):
        add("export", "model", [f"{root / ex['export_dir']} ({ex['parameters']:,} parameters)"])
    if wu := info.get("warmup"):
        add(
            "warmup",
            "warmup",
            [
                f"{wu['graphs']} graphs compiled in {wu['compile_seconds_total']:.1f}s cold, "
                f"{wu['warm_start_seconds_total']:.1f}s warm ({wu['warm_speedup']:.1f}x)"
            ],
        )
    if sv := info.get("serve-check"):
        exact, padded = sv["exact"], sv["padded"]
        ratio_key = next(k for k in sv if k.startswith("decode_cost_ratio_"))
        add(
            "serve-check",
            "serving",
            [
                f"{sv['headline_workload']}: padded {padded['output_tokens_per_s']:.0f} tokens/s, "
                f"{padded['compile_events']} compiles, TTFT p99 {padded['ttft_p99_s']:.3f}s | exact "
                f"{exact['output_tokens_per_s']:.0f} tokens/s, "
                f"compiles {exact['compile_step_share']:.1%} of steps, "
                f"{exact['compile_time_share']:.1%} of decode time",
                f"{ratio_key} = {sv[ratio_key]:.3f}; gates {_verdict(sv['passed'])}",
            ]
            + _live_line(sv),
        )
    if nm := info.get("numerics"):
        f32, b16 = nm["fp32"]["prefill"], nm["bf16"]["prefill"]
        add(
            "numerics",
            "numerics",
            [
                f"fp32 compiled vs fp64 rel RMS {f32['rel_rms_compiled_vs_fp64']:.1e}, max |compiled-eager| "
                f"{nm['max_abs_logit_diff_fp32']:.1e}; "
                f"bf16 compiled {b16['rel_rms_compiled_vs_fp64']:.1e} vs eager "
                f"{b16['rel_rms_eager_vs_fp64']:.1e}; gates {_verdict(nm['passed'])}"
            ],
        )
    if pr := info.get("probes"):
        lines = []
        if grid := pr.get("mqar_trained_accuracy") or {}:
            ctx = sorted(grid, key=int)
            easy, hard = grid[ctx[0]], grid[ctx[-1]]
            lines.append(
                f"MQAR-trained GLA: {max(easy.values()):.0%} at {ctx[0]} tokens, "
                f"{min(hard.values()):.0%} at {ctx[-1]}; exported model MQAR "
                f"{max(pr['mqar_accuracy'].values()):.0%}, passkey {pr['passkey_accuracy_overall']:.0%}"
            )
        lines.append(
            f"state {pr['state_bytes_measured']:,} B/sequence vs KV@8192 {pr['kv_bytes_8192']:,} B; "
            f"3B: {pr['laplace_3b_state_bytes'] / 1e6:.1f} MB vs {pr['laplace_3b_kv_bytes_8192'] / 1e9:.2f} GB "
            f"({pr['laplace_3b_state_vs_kv_8192']:.1f}x); gates {_verdict(pr['passed'])}"
        )
        add("probes", "probes", lines)
    if trk := info.get("tracking"):
        lines = [f"run {trk['run_id']} in {trk['tracking_uri']}"]
        if trk.get("model_version"):
            alias = "champion" if trk.get("champion") else "candidate"
            lines.append(f"registered {trk['model_name']} v{trk['model_version']} as {alias}")
            if trk.get("registered_reason"):
                lines[-1] += f": {trk['registered_reason']}"
        out.append(("mlflow", lines))
    return out


def _live_line(sv: dict) -> list[str]:
    live, ratio = sv.get("live"), sv.get("live_vs_replay") or {}
    if not live:
        return []
    return [
        f"live laplace serve: {live['output_tokens_per_s']:.0f} tokens/s "
        f"({ratio.get('output_tokens_per_s', 0):.2f}x the replay), TTFT p99 {live['ttft_p99_s'] or 0:.3f}s "
        f"({ratio.get('ttft_p99_s', 0):.2f}x), {live['compile_events']:.0f} compiles, "
        f"{live['served']}/{live['requests']} served"
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
    trk = (info or {}).get("tracking") or {}
    ui = [f"mlflow ui --backend-store-uri sqlite:///{root / 'mlflow.db'} --host 127.0.0.1 --port 5000"]
    if trk.get("tracking_uri", "").startswith("http"):
        ui = []  # a tracking server serves its own UI
    if trk.get("ui_url"):
        ui.append(f"open {trk['ui_url']}")
    return [
        "dvc metrics diff ; dvc exp show --only-changed --drop 'Created|laplace|.*/.*'   (docs/pipeline.md)",
        "dvc plots show   (open dvc_plots/index.html)",
        *ui,
        "make prefect-server ; make prefect-worker ; export PREFECT_API_URL=http://127.0.0.1:4200/api ;"
        " prefect deployment run 'laplace-pipeline/tiny'",
    ]


def as_text(info: dict, root: Path) -> str:
    lines = ["", "=== Laplace pipeline ==="]
    for topic, texts in rows(info, root) + [("next", next_steps(root, info))]:
        for i, text in enumerate(texts):
            lines.append(f"{topic if i == 0 else '':<12}{text}")
    return "\n".join(lines)


def as_markdown(info: dict, root: Path) -> str:
    table = "\n".join(
        f"| {topic} | {'<br>'.join(t.replace('|', '/') for t in texts)} |" for topic, texts in rows(info, root)
    )
    return f"# Laplace pipeline\n\n| stage | figures |\n|---|---|\n{table}\n"
