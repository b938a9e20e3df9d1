"""The architecture comparison: pure GLA, hybrids and a softmax model, trained and measured alike.

`laplace compare-arm ARM` (compare/dvc.yaml's `arm@ARM`, one stage per `compare.arms` entry, so
DVC reruns only the arms whose params or code changed) runs the pipeline's own stages for one
architecture, with its files under runs/, artifacts/, metrics/ and plots/ `compare/ARM`: warmup,
train, export, probes (the recall suite, MQAR trained on the arm's architecture), then the
architecture figures (serving bytes per sequence from the engine's own allocations beside the
formula, decode time against context, the serve-check workload through the compiled engine,
RULER through lm-eval: laplace.evals.architectures). Every arm reads the same corpus shards, tokenizer, seed, steps and
server settings: params.yaml's, with `compare.overrides` on top, the same for every arm.

`laplace compare` (the `table` stage) reads every arm's figures and writes the table
(metrics/compare.json), the comparison plots and the headline sentence, and logs them to MLflow
(one parent run, a child run per arm)."""

from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

from laplace.config import Config, config_from_dict
from laplace.errors import ConfigError, InputError
from laplace.fileio import atomic_write_json
from laplace.pipeline.layout import Paths
from laplace.pipeline.params import apply_overrides

# the pipeline stages every arm runs, in order (their modules write metrics/compare/ARM/<stage>.json);
# by module, not through the stage registry, which imports every stage (compare/dvc.yaml names these)
ARM_STAGES = ("warmup", "train", "export", "probes")
ARCH_FIGURES = "architecture"  # metrics/compare/ARM/architecture.json (laplace.evals.architectures)
TABLE = "compare"  # metrics/compare.json


@dataclass(frozen=True)
class ArmPaths(Paths):
    """One arm's files: its own run, export, compile cache, figures and plots; the corpus shards,
    tokenizer and imports are the project's (every arm trains on the same tokens)."""

    arm: str = ""

    @property
    def run_dir(self) -> Path:
        return self.root / "runs" / "compare" / self.arm

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def export_dir(self) -> Path:
        return self.root / "artifacts" / "compare" / self.arm / "export"

    @property
    def warmup_cache(self) -> Path:
        return self.root / "artifacts" / "compare" / self.arm / "warmup" / "compile-cache"

    @property
    def metrics_dir(self) -> Path:
        return self.root / "metrics" / "compare" / self.arm

    @property
    def plots_dir(self) -> Path:
        return self.root / "plots" / "compare" / self.arm


def arm_paths(paths: Paths, arm: str) -> ArmPaths:
    return ArmPaths(paths.root, arm)


def comparison_plots_dir(paths: Paths) -> Path:
    return paths.plots_dir / "compare"


def arm_config(cfg: Config, arm: str) -> Config:
    """The arm's whole config: params.yaml's, then compare.overrides, then the arm's model.* keys.

    The arm's architecture is what it states on top of params.yaml's model section, less `attn`
    and `init` (a GLA arm must not inherit a hybrid's attention layers from the main pipeline's
    model): an arm without `attn` takes its preset's. A bad arm is a ConfigError naming
    `compare.arms.ARM.KEY`."""
    arms = cfg.compare.arms
    if arm not in arms:
        raise ConfigError(f"compare.arms: no arm {arm!r} (arms: {', '.join(arms)})")
    raw = cfg.to_dict()
    raw["compare"] = {**raw["compare"], "arms": {arm: arms[arm]}}
    try:
        raw = apply_overrides(raw, dict(cfg.compare.overrides))
    except ConfigError as exc:
        raise ConfigError(f"compare.overrides: {exc}") from None
    model = {**raw["model"], "attn": None, "init": ""}
    for key, value in arms[arm].items():
        if key not in model:
            raise ConfigError(f"compare.arms.{arm}.{key}: not a model.* knob")
        model[key] = copy.deepcopy(value)
    raw["model"] = model
    try:
        return config_from_dict(raw)
    except ConfigError as exc:
        text = str(exc)
        prefix = f"compare.arms.{arm}." if text.startswith("model.") else f"compare.arms.{arm}: "
        raise ConfigError(prefix + text) from None


def check_arms(cfg: Config) -> dict[str, Config]:
    """Every arm's config, built now: a bad arm stops the comparison before any work."""
    return {arm: arm_config(cfg, arm) for arm in cfg.compare.arms}


# --------------------------------------------------------------------------- one arm


def run_arm(cfg: Config, paths: Paths, arm: str) -> dict:
    """Run the pipeline's stages for one arm, then its architecture figures; returns those figures."""
    from laplace.pipeline import stage_export, stage_probes, stage_train, stage_warmup
    from laplace.pipeline.layout import stamp_measurement
    from laplace.pipeline.workers import run_worker_from_warmup_cache

    modules = {"warmup": stage_warmup, "train": stage_train, "export": stage_export, "probes": stage_probes}
    acfg = arm_config(cfg, arm)
    ap = arm_paths(paths, arm)
    if not (paths.data_dir / "manifest.json").exists():
        raise InputError(f"no token shards in {paths.data_dir}: run `dvc repro tokenize` (or `laplace tokenize`) first")
    seconds = {}
    for name in ARM_STAGES:
        started, wall = time.time(), time.perf_counter()
        print(f"compare {arm}: {name}", flush=True)
        try:
            modules[name].run(acfg, ap)
        finally:  # the figures name their measurement, as the pipeline's stages' do (layout.stamp_measurement)
            stamp_measurement(ap, name, started)
        seconds[name] = round(time.perf_counter() - wall, 3)
    started = time.perf_counter()
    args = ["--export-dir", str(ap.export_dir), "--data-dir", str(paths.data_dir)]
    figures = run_worker_from_warmup_cache("laplace.pipeline.compare", acfg, args, ap.warmup_cache)
    seconds[ARCH_FIGURES] = round(time.perf_counter() - started, 3)
    figures = {**figures, "arm": arm, "stage_seconds": seconds}
    atomic_write_json(ap.metrics_file(ARCH_FIGURES), figures)
    return figures


def main(argv: list[str] | None = None) -> int:
    """The architecture-figures worker: `python -m laplace.pipeline.compare --config-json C --out O
    --export-dir E --data-dir D` (a fresh process started from the arm's warmup cache)."""
    from laplace.pipeline.workers import worker_main

    def body(cfg: Config, args) -> dict:
        from laplace.evals.architectures import architecture_figures

        return architecture_figures(cfg, args.export_dir, args.data_dir)

    return worker_main("architecture figures of one compare arm", body, argv, paths=("export-dir", "data-dir"))


# --------------------------------------------------------------------------- the table


def _read(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def arm_figures(paths: Paths, arm: str) -> dict:
    """Every figure one arm wrote, by stage; InputError naming the arm when it has not finished."""
    ap = arm_paths(paths, arm)
    out = {}
    for name in (*ARM_STAGES, ARCH_FIGURES):
        data = _read(ap.metrics_file(name))
        if data is None:
            raise InputError(
                f"compare arm {arm!r} has no {ap.metrics_file(name).relative_to(paths.root)}: "
                f"run `dvc repro compare/dvc.yaml` (or `laplace compare-arm {arm}`) first"
            )
        out[name] = data
    return out


def _mean(values) -> float | None:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(values) / len(values) if values else None


def recall_by_length(probes: dict) -> dict[int, float]:
    """The exported model's recall suite per length: the mean over the tasks measured there."""
    by_length: dict[int, list[float]] = {}
    for grid in (probes.get("recall") or {}).values():
        for length, acc in (grid or {}).items():
            by_length.setdefault(int(length), []).append(acc)
    return {n: _mean(v) for n, v in sorted(by_length.items())}


def trained_recall_by_length(probes: dict) -> dict[int, float]:
    """MQAR recall of the model of the arm's architecture trained on MQAR: per context, the mean
    over pair counts (the grid's cells that fit)."""
    grid = probes.get("mqar_trained_accuracy") or {}
    return {int(c): _mean(row.values()) for c, row in sorted(grid.items(), key=lambda kv: int(kv[0]))}


def table_row(arm: str, figures: dict, table_contexts: list[int]) -> dict:
    """One row of the comparison table, from one arm's figures."""
    train, probes, arch = figures["train"], figures["probes"], figures[ARCH_FIGURES]
    padded = arch.get("serving") or {}
    decode = arch.get("decode_ms_per_token") or {}
    memory = arch.get("bytes_per_sequence") or {}
    return {
        "arm": arm,
        "family": arch.get("family"),
        "attn_layers": arch.get("attn_layers"),
        "parameters": figures["export"].get("parameters"),
        "val_loss": train.get("val_loss"),
        "perplexity": math.exp(train["val_loss"]) if train.get("val_loss") is not None else None,
        "recall": {str(n): v for n, v in recall_by_length(probes).items()},
        "recall_trained_mqar": {str(n): v for n, v in trained_recall_by_length(probes).items()},
        "mqar_trained_samples": probes.get("mqar_trained_samples"),
        "bytes_per_sequence": memory,
        "bytes_per_sequence_formula": arch.get("bytes_per_sequence_formula") or {},
        "decode_ms_per_token": {str(c): decode.get(str(c)) for c in table_contexts} | decode,
        "output_tokens_per_s": padded.get("output_tokens_per_s"),
        "ttft_p99_s": padded.get("ttft_p99_s"),
        "compiles_while_serving": padded.get("compile_events"),
    }


def _gap_recovered(rows: dict, arm: str, length: str, key: str) -> float | None:
    """(arm - gla) / (softmax - gla) of a recall figure at one length: the share of the gap closed."""
    fam = {r["family"]: r for r in rows.values()}
    gla, soft = fam.get("gla"), fam.get("softmax")
    if gla is None or soft is None:
        return None
    lo, hi, mid = gla[key].get(length), soft[key].get(length), rows[arm][key].get(length)
    if None in (lo, hi, mid) or hi - lo <= 0:
        return None
    return (mid - lo) / (hi - lo)


def headline(rows: dict, memory_context: int) -> str:
    """The trade in one sentence: how much of the softmax model's MQAR-trained recall each hybrid
    recovered (the gap between GLA and softmax closed), for how many times GLA's serving bytes."""
    fam = {r["family"]: r for r in rows.values()}
    gla, soft = fam.get("gla"), fam.get("softmax")
    if gla is None or soft is None:
        return "the comparison needs a gla and a softmax arm to state the trade"
    key, at = str(memory_context), None
    lengths = sorted(set(gla["recall_trained_mqar"]) & set(soft["recall_trained_mqar"]), key=int)
    if lengths:
        at = lengths[-1]
    parts = []
    for arm, row in rows.items():
        if row["family"] != "hybrid" or at is None:
            continue
        share = _gap_recovered(rows, arm, at, "recall_trained_mqar")
        mine, base = row["bytes_per_sequence"].get(key), gla["bytes_per_sequence"].get(key)
        top = soft["bytes_per_sequence"].get(key)
        if share is None or not mine or not base or not top:
            continue
        parts.append(
            f"{arm} recovered {share:.0%} of the softmax model's MQAR-trained recall at {at} tokens "
            f"(over pure GLA) for {mine / base:.1f}x GLA's serving bytes per sequence at {memory_context} "
            f"({top / mine:.1f}x less than softmax)"
        )
    if not parts:
        return (
            f"no hybrid arm measured against both ends (softmax vs gla MQAR-trained recall at {at} tokens: "
            f"{soft['recall_trained_mqar'].get(at)} vs {gla['recall_trained_mqar'].get(at)})"
        )
    return "; ".join(parts)


def binomial_se(p: float, n: int) -> float:
    return math.sqrt(max(p * (1 - p), 1.0 / max(n, 1)) / max(n, 1))


def pick(rows: dict, tolerance_se: float, memory_context: int, candidates: list[str] | None = None) -> dict:
    """The comparison's choice: the arm with the smallest serving bytes per sequence at
    `memory_context` whose MQAR-trained recall at every length is within `tolerance_se` binomial
    standard errors of the best arm's there (`candidates`: only these arms, e.g. one family).
    Returns {arm, reason}."""
    names = candidates or list(rows)
    key = str(memory_context)
    lengths = sorted({n for a in names for n in rows[a]["recall_trained_mqar"]}, key=int)
    samples = {a: rows[a].get("mqar_trained_samples") or {} for a in names}
    ok, why = [], {}
    for a in names:
        misses = []
        for n in lengths:
            mine = rows[a]["recall_trained_mqar"].get(n)
            best_arm = max(names, key=lambda b: rows[b]["recall_trained_mqar"].get(n) or -1)
            best = rows[best_arm]["recall_trained_mqar"].get(n)
            if mine is None or best is None:
                continue
            count = int(samples[a].get(n) or 1)
            bound = tolerance_se * math.hypot(binomial_se(mine, count), binomial_se(best, count))
            if best - mine > bound:
                misses.append(f"{mine:.2f} vs {best_arm}'s {best:.2f} at {n} (> {bound:.2f}, {count} queries each)")
        if misses:
            why[a] = "; ".join(misses)
        else:
            ok.append(a)
    if not ok:
        return {"arm": None, "reason": "no arm is within the tolerance of the best at every length"}
    chosen = min(ok, key=lambda a: rows[a]["bytes_per_sequence"].get(key) or math.inf)
    out_of = [a for a in names if a != chosen]
    reason = (
        f"the smallest serving bytes per sequence at {memory_context} "
        f"({rows[chosen]['bytes_per_sequence'].get(key):,} B) among the arms whose MQAR-trained recall is within "
        f"{tolerance_se:g} standard errors of the best at every length"
    )
    if why:
        reason += "; left out: " + "; ".join(f"{a} ({w})" for a, w in why.items() if a in out_of)
    return {"arm": chosen, "reason": reason}


def build_table(cfg: Config, paths: Paths) -> dict:
    """metrics/compare.json: the table's rows, the headline, the overall pick and one per family."""
    c = cfg.compare
    configs = check_arms(cfg)
    rows = {arm: table_row(arm, arm_figures(paths, arm), c.table_contexts) for arm in configs}
    memory_context = 8192 if 8192 in c.memory_contexts else max(c.memory_contexts)
    families: dict[str, list[str]] = {}
    for arm, row in rows.items():
        families.setdefault(row["family"], []).append(arm)
    return {
        "arms": rows,
        "headline": headline(rows, memory_context),
        "pick": pick(rows, c.champion_recall_tolerance, memory_context),
        "family_picks": {
            f: pick(rows, c.champion_recall_tolerance, memory_context, arms) for f, arms in families.items()
        },
        "memory_context": memory_context,
    }


def _fmt(v, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def format_table(table: dict, table_contexts: list[int]) -> str:
    rows = table["arms"]
    lengths = sorted({n for r in rows.values() for n in r["recall"]}, key=int)
    trained = sorted({n for r in rows.values() for n in r["recall_trained_mqar"]}, key=int)
    mem = str(table["memory_context"])
    head = (
        ["arm", "family", "params", "val loss"]
        + [f"recall@{n}" for n in lengths]
        + [f"mqar@{n}" for n in trained]
        + [f"B/seq@{mem}"]
        + [f"ms/tok@{c}" for c in table_contexts]
        + ["tok/s", "compiles"]
    )
    body = []
    for r in rows.values():
        body.append(
            [r["arm"], r["family"], _fmt(r["parameters"], ","), _fmt(r["val_loss"], ".3f")]
            + [_fmt(r["recall"].get(n), ".2f") for n in lengths]
            + [_fmt(r["recall_trained_mqar"].get(n), ".2f") for n in trained]
            + [_fmt(r["bytes_per_sequence"].get(mem), ",")]
            + [_fmt(r["decode_ms_per_token"].get(str(c)), ".2f") for c in table_contexts]
            + [_fmt(r["output_tokens_per_s"], ".0f"), _fmt(r["compiles_while_serving"], "d")]
        )
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(b, widths)) for b in body]
    p = table["pick"]
    lines.append(f"headline    {table['headline']}")
    lines.append(f"pick        {p['arm'] or 'none'}: {p['reason']}")
    return "\n".join(lines)


def plot_rows(table: dict) -> dict[str, list[dict]]:
    """DVC plot data (plots/compare/*.json), one line (`series`) per arm."""
    rows = table["arms"]

    def series(key: str, y: str) -> list[dict]:
        out = []
        for order, (arm, r) in enumerate(rows.items()):
            out += [
                {"context": int(n), y: v, "series": arm, "order": order} for n, v in r[key].items() if v is not None
            ]
        return sorted(out, key=lambda row: (row["order"], row["context"]))

    mem = str(table["memory_context"])
    frontier = [
        {
            "bytes_per_sequence": r["bytes_per_sequence"].get(mem),
            "recall": _mean(r["recall_trained_mqar"].values()),
            "series": arm,
            "order": order,
        }
        for order, (arm, r) in enumerate(rows.items())
        if r["bytes_per_sequence"].get(mem) is not None
    ]
    return {
        "recall_trained": series("recall_trained_mqar", "accuracy"),
        "recall": series("recall", "accuracy"),
        "bytes": series("bytes_per_sequence", "bytes"),
        "decode": series("decode_ms_per_token", "ms_per_token"),
        "frontier": frontier,
    }


def run_table(cfg: Config, paths: Paths, track: bool = True) -> dict:
    """The `table` stage: metrics/compare.json, plots/compare/*.json and *.png, and (track) MLflow."""
    from laplace.pipeline.plots import comparison_plots, write_rows

    table = build_table(cfg, paths)
    out_dir = comparison_plots_dir(paths)
    data = plot_rows(table)
    for name, rows in data.items():
        write_rows(out_dir / f"{name}.json", rows)
    comparison_plots(table, out_dir)
    atomic_write_json(paths.metrics_file(TABLE), table)
    if track:
        from laplace.tracking.compare import log_comparison

        # run ids change on every log: kept out of the metrics file DVC compares
        dirs = {arm: (arm_paths(paths, arm).metrics_dir, arm_paths(paths, arm).export_dir) for arm in table["arms"]}
        atomic_write_json(tracking_file(paths), log_comparison(cfg, paths.root, table, out_dir, dirs))
    return table


def tracking_file(paths: Paths) -> Path:
    return paths.root / "artifacts" / "compare-tracking.json"


if __name__ == "__main__":
    import sys

    sys.exit(main())
