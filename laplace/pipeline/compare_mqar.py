"""The comparison's MQAR protocol as stages (laplace.evals.mqar_protocol holds the science).

`laplace mqar-cell ARM WIDTH LR SEED` (compare/dvc.yaml's `cell@ARM-WIDTH-LR-SEED`, a DVC matrix
over mqar.arms x mqar.widths x mqar.lrs x mqar.seeds, each cell depending on its own arm's
compare.arms entry) trains and tests one cell and writes compare/mqar/cells/ARM-wWIDTH-lrLR-sSEED.json;
each cell is cached on its own, so adding an arm, a width, a seed or a rate trains only the new
cells. `laplace mqar` (the `mqar` stage) reads the grid's
cells and writes compare/mqar/protocol.json: every model's per-rate results, its best rate's
accuracy with the error over seeds, the validity gate and the recall-versus-state frontier, with
the frontier and learning-rate plots beside it."""

from __future__ import annotations

import json
from pathlib import Path

from laplace.config import Config
from laplace.errors import ConfigError, InputError
from laplace.evals.mqar_protocol import (
    cell_name,
    check_protocol,
    frontier,
    matched_state,
    model_name,
    models,
    same_computation,
    summarize,
    train_cell,
    validity_gate,
)
from laplace.fileio import atomic_write_json
from laplace.model.config import ModelConfig
from laplace.pipeline.compare import COMPARE_DIR, arm_config
from laplace.pipeline.layout import Paths


def mqar_dir(paths: Paths) -> Path:
    return paths.root / COMPARE_DIR / "mqar"


def cell_file(paths: Paths, model: str, lr: float, seed: int) -> Path:
    return mqar_dir(paths) / "cells" / f"{cell_name(model, lr, seed)}.json"


def protocol_file(paths: Paths) -> Path:
    return mqar_dir(paths) / "protocol.json"


def arm_models(cfg: Config) -> dict[str, ModelConfig]:
    """Every arm's architecture (its attention pattern is what the protocol's models take)."""
    return {arm: arm_config(cfg, arm).model_config() for arm in cfg.compare.arms}


def run_cell(cfg: Config, paths: Paths, arm: str, width: int, lr: float, seed: int, progress: bool = True) -> dict:
    """One cell of the grid, written atomically (a killed cell leaves no file and reruns whole)."""
    m = cfg.mqar
    for knob, value, grid in (
        ("arms", arm, m.arms),
        ("widths", width, m.widths),
        ("lrs", lr, m.lrs),
        ("seeds", seed, m.seeds),
    ):
        if value not in grid:
            raise ConfigError(f"mqar-cell: {value!r} is not one of mqar.{knob} {grid}")
    archs = arm_models(cfg)
    check_protocol(m, archs)
    result = _computed_by_another_arm(cfg, paths, arm, archs, width, lr, seed)
    if result is None:
        result = train_cell(m, arm, archs[arm], width, lr, seed, progress)
    atomic_write_json(cell_file(paths, model_name(arm, width), lr, seed), result)
    return result


def _computed_by_another_arm(cfg: Config, paths: Paths, arm: str, archs: dict, width: int, lr: float, seed: int):
    """Another arm's finished cell of the very same computation, relabelled as this arm's (or None)."""
    for other in (a for a in cfg.mqar.arms if a != arm):
        try:
            cell = json.loads(cell_file(paths, model_name(other, width), lr, seed).read_text())
        except (OSError, ValueError):
            continue
        if same_computation(cfg.mqar, archs[arm], width, lr, seed, cell):
            return {**cell, "model": model_name(arm, width), "arm": arm, "same_as": cell["model"]}
    return None


def read_cells(cfg: Config, paths: Paths) -> list[dict]:
    """The grid's cells (files of cells no longer in the grid are ignored); a missing one is an InputError."""
    m, cells, missing = cfg.mqar, [], []
    for model in models(m):
        for lr in m.lrs:
            for seed in m.seeds:
                path = cell_file(paths, model, lr, seed)
                try:
                    cells.append(json.loads(path.read_text()))
                except (OSError, ValueError):
                    missing.append(path.stem)
    if missing:
        raise InputError(
            f"mqar: {len(missing)} cell(s) not run ({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}): "
            "run `cd compare && dvc repro` (or `laplace mqar-cell ARM WIDTH LR SEED`)"
        )
    return cells


def run_protocol(cfg: Config, paths: Paths) -> dict:
    """The `mqar` stage: protocol.json and the protocol's plots from the grid's cells."""
    from laplace.pipeline.plots import mqar_plots, write_rows

    m = cfg.mqar
    archs = arm_models(cfg)
    check_protocol(m, archs)
    summary = summarize(m, read_cells(cfg, paths))
    result = {
        "models": summary,
        "gate": validity_gate(m, summary),
        "frontier": frontier(summary),
        "matched_state": matched_state(m, summary, archs),
        "settings": {
            k: getattr(m, k)
            for k in ("vocab", "seq_len", "train_pairs", "steps", "batch_size", "layers", "heads", "lrs", "seeds")
        },
        "reference": {"context": m.seq_len, "pairs": m.reference_pairs},
        "significance_se": m.significance_se,
    }
    plots = paths.root / COMPARE_DIR / "plots"
    write_rows(plots / "mqar_frontier.json", frontier_rows(result["frontier"]))
    write_rows(plots / "mqar_lrs.json", lr_rows(summary))
    mqar_plots(result, plots)
    atomic_write_json(protocol_file(paths), result)
    return result


def frontier_rows(points: list[dict]) -> list[dict]:
    """DVC plot rows: accuracy against bytes per sequence, a series per (length, pairs)."""
    return [
        {
            "bytes_per_sequence": p["bytes_per_sequence"],
            "accuracy": p["accuracy"],
            "se": p["se"],
            "model": p["model"],
            "series": f"{p['pairs']} pairs @ {p['context']}",
        }
        for p in points
    ]


def lr_rows(summary: dict) -> list[dict]:
    """DVC plot rows: each model's grid score (mean accuracy over test cells and seeds) per learning rate."""
    return [
        {"lr": float(lr), "accuracy": r["score"], "series": model}
        for model, s in summary.items()
        for lr, r in s["lrs"].items()
    ]


def format_protocol(result: dict) -> str:
    """The protocol's table as text: a row per model, its best rate, accuracy ± se per test cell."""
    models = result["models"]
    cells = sorted({(int(c), int(p)) for s in models.values() for c, row in s["accuracy"].items() for p in row})
    head = ["model", "family", "best lr", "B/seq"] + [f"{p}p@{c}" for c, p in cells]
    body = []
    for name, s in models.items():
        ctx = str(cells[-1][0])
        edge = "*" if s.get("best_lr_at_grid_edge") else ""
        body.append(
            [name, s["family"], f"{s['best_lr']:g}{edge}", f"{s['bytes_per_sequence'][ctx]:,}"]
            + [
                f"{s['accuracy'][str(c)][str(p)]['mean']:.3f}±{s['accuracy'][str(c)][str(p)]['se']:.3f}"
                for c, p in cells
            ]
        )
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(b, widths)) for b in body]
    if edges := [name for name, s in models.items() if s.get("best_lr_at_grid_edge")]:
        lines.append(
            f"* best rate at an end of mqar.lrs ({', '.join(edges)}): the grid does not bracket their optimum; "
            "extend it there"
        )
    for pair in result.get("matched_state", []):
        diffs = ", ".join(
            f"{p}p@{c} {pair['cells'][str(c)][str(p)]['difference']:+.3f} "
            f"({pair['cells'][str(c)][str(p)]['z']:+.1f} SE, {pair['cells'][str(c)][str(p)]['verdict']})"
            for c, p in cells
        )
        lines.append(f"equal state  {pair['gdn']} - {pair['gla']}: {diffs}")
    gate = result["gate"]
    lines.append(f"gate        {'passed' if gate['passed'] else 'FAILED'}")
    lines += [f"  {'ok  ' if c['passed'] else 'FAIL'} {c['check']}: {c['detail']}" for c in gate["checks"]]
    return "\n".join(lines)
