"""The architecture comparison: pure GLA, hybrids and a softmax model, trained and measured alike.

`laplace compare-arm ARM` (compare/dvc.yaml's `arm@ARM`, one stage per `compare.arms` entry, so
DVC reruns only the arms whose params or code changed) runs the pipeline's own stages for one
architecture, with its files under compare/ runs/, artifacts/, metrics/ and plots/ `ARM`: warmup,
train, export, probes (the recall suite, MQAR trained on the arm's architecture), then the
architecture figures (serving bytes per sequence from the engine's own allocations beside the
formula, decode time against context, the serve-check workload through the compiled engine,
RULER through lm-eval: laplace.evals.architectures). Every arm reads the same corpus shards, tokenizer, seed, steps and
server settings: params.yaml's, with `compare.overrides` on top, the same for every arm.

`laplace compare` (the `table` stage, laplace.pipeline.compare_table) reads every arm's figures and
writes the table, the plots and the headline sentence.

compare/ is a DVC repository of its own (`dvc init --subdir`): the project's `dvc status`, `dvc
repro` and `dvc pull` never see the comparison's stages, so a project that never compared stays
clean; its arms depend on the project's token shards, imports and params.yaml."""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass
from pathlib import Path

from laplace.config import Config, config_from_dict
from laplace.errors import ConfigError, InputError
from laplace.fileio import atomic_write_json
from laplace.pipeline.layout import Paths
from laplace.pipeline.params import apply_overrides

# the pipeline stages every arm runs, in order (their modules write compare/metrics/ARM/<stage>.json);
# by module, not through the stage registry, which imports every stage (compare/dvc.yaml names these)
ARM_STAGES = ("warmup", "train", "export", "probes")
ARCH_FIGURES = "architecture"  # compare/metrics/ARM/architecture.json (laplace.evals.architectures)
COMPARE_DIR = "compare"  # the comparison's own DVC repository, in the project's root


@dataclass(frozen=True)
class ArmPaths(Paths):
    """One arm's files: its own run, export, compile cache, figures and plots; the corpus shards,
    tokenizer and imports are the project's (every arm trains on the same tokens)."""

    arm: str = ""

    @property
    def run_dir(self) -> Path:
        return self.root / COMPARE_DIR / "runs" / self.arm

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def export_dir(self) -> Path:
        return self.root / COMPARE_DIR / "artifacts" / self.arm / "export"

    @property
    def warmup_cache(self) -> Path:
        return self.root / COMPARE_DIR / "artifacts" / self.arm / "warmup" / "compile-cache"

    @property
    def metrics_dir(self) -> Path:
        return self.root / COMPARE_DIR / "metrics" / self.arm

    @property
    def plots_dir(self) -> Path:
        return self.root / COMPARE_DIR / "plots" / self.arm


def arm_paths(paths: Paths, arm: str) -> ArmPaths:
    return ArmPaths(paths.root, arm)


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
    c = cfg.compare
    if unmeasured := [n for n in c.table_contexts if n not in c.decode_contexts]:
        raise ConfigError(
            f"compare.table_contexts: {unmeasured} not in compare.decode_contexts={c.decode_contexts} "
            "(the table shows decode time where it was measured)"
        )
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


# --------------------------------------------------------------------------- an arm's figures


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
                f"run `cd compare && dvc repro` (or `laplace compare-arm {arm}`) first"
            )
        out[name] = data
    return out


if __name__ == "__main__":
    import sys

    sys.exit(main())
