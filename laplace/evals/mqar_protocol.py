"""The MQAR protocol: recall measured the way the field measures it (Zoology, arXiv 2312.04927).

Every (architecture, width) model trains once per learning rate of a grid and per seed; each is
tested on the same fresh sequences (at least `test_queries` queries per length and pair count). A
model reports its best learning rate's accuracy (the mean over seeds, each seed's value, the
standard error across seeds), so no architecture runs at a rate tuned for another. Before any
verdict a validity gate reproduces what is known: all-attention solves the reference cell, and a
pure GLA falls as the pairs outgrow its state and rises with width. The recall-versus-state
frontier puts each model's accuracy beside its serving bytes per sequence (Based, arXiv
2402.18668).

One cell (`train_cell`) is one (model, learning rate, seed): DVC caches each on its own
(compare/dvc.yaml's `mqar@...` matrix), so adding a seed or a rate trains only the new cells.
`summarize` and `validity_gate` read the cells' results; nothing here knows about DVC or files.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

import numpy as np

from laplace.config import MqarSection
from laplace.errors import ConfigError, InputError
from laplace.evals.mqar import (
    MqarTraining,
    mqar_accuracy_eager,
    mqar_batch,
    mqar_chance,
    mqar_ranges,
    small_mqar_model,
    train_on_mqar,
)
from laplace.model.config import ModelConfig, architecture_family
from laplace.model.lm import sequence_bytes


def model_name(arm: str, width: int) -> str:
    return f"{arm}-w{width}"


def models(mqar: MqarSection) -> list[str]:
    """Every (architecture, width) of the grid, arm by arm."""
    return [model_name(arm, w) for arm in mqar.arms for w in mqar.widths]


def cell_name(model: str, lr: float, seed: int) -> str:
    """A cell's file stem: gla-w64-lr0.005-s0."""
    return f"{model}-lr{lr:g}-s{seed}"


def protocol_model_config(mqar: MqarSection, arm_model: ModelConfig, width: int) -> ModelConfig:
    """The MQAR model of an arm at `width`: the arm's pattern of attention and Gated DeltaNet layers in
    mqar.layers layers, a GDN layer with a GLA layer's state bytes and its decays started near 1."""
    return small_mqar_model(
        arm_model,
        vocab_size=mqar.vocab,
        d_model=width,
        layers=mqar.layers,
        heads=mqar.heads,
        gate_bias=mqar.gate_bias,
        seq_len=mqar.seq_len,
        gdn_dt_init=mqar.gdn_dt_init,
    )


def scored_cells(mqar: MqarSection) -> list[tuple[int, int]]:
    """The (length, pairs) test cells that fit: 4 tokens per pair and distinct keys."""
    n_keys = len(mqar_ranges(mqar.vocab)[1])
    return [(c, p) for c in mqar.contexts for p in mqar.pairs if 4 * p <= c and p <= n_keys]


def check_protocol(mqar: MqarSection, arm_models: dict[str, ModelConfig]) -> None:
    """A protocol that cannot measure what it claims stops before any training, naming the knob."""
    n_keys = len(mqar_ranges(mqar.vocab)[1])
    if 4 * mqar.train_pairs > mqar.seq_len or mqar.train_pairs > n_keys:
        raise ConfigError(
            f"mqar.train_pairs={mqar.train_pairs} does not fit mqar.seq_len={mqar.seq_len} (4 tokens per pair) "
            f"and mqar.vocab={mqar.vocab} ({n_keys} key ids)"
        )
    if (mqar.seq_len, mqar.reference_pairs) not in scored_cells(mqar):
        raise ConfigError(
            f"mqar.reference_pairs={mqar.reference_pairs}: the gate's reference cell ({mqar.seq_len} tokens, "
            f"{mqar.reference_pairs} pairs) must be one of the test cells (mqar.contexts x mqar.pairs)"
        )
    if unknown := [a for a in mqar.arms if a not in arm_models]:
        raise ConfigError(f"mqar.arms: {unknown} not in compare.arms ({', '.join(arm_models)})")
    if missing := [a for a in arm_models if a not in mqar.arms]:
        raise ConfigError(f"mqar.arms: no MQAR model for arm(s) {missing}: the pick needs every arm's recall")
    for w in mqar.widths:
        if w % mqar.heads or (w // 2) % mqar.heads:
            raise ConfigError(f"mqar.widths: {w} does not split into mqar.heads={mqar.heads} heads")


# --------------------------------------------------------------------------- one cell


def train_cell(
    mqar: MqarSection, arm: str, arm_model: ModelConfig, width: int, lr: float, seed: int, progress: bool = True
) -> dict:
    """Train one (model, learning rate, seed) cell on MQAR and test it: the cell's figures (JSON-ready).

    `accuracy` and `queries` are {length: {pairs: value}} over `scored_cells`; the test sequences come
    from mqar.test_seed, the same for every cell, so models are compared on identical queries."""
    cfg = protocol_model_config(mqar, arm_model, width)
    how = training(mqar, lr)
    start = time.perf_counter()
    trained, losses = train_on_mqar(cfg, how, seed, progress)
    train_seconds = time.perf_counter() - start
    accuracy: dict[str, dict[str, float]] = {}
    queries: dict[str, dict[str, int]] = {}
    for ctx, pairs in scored_cells(mqar):
        samples = math.ceil(mqar.test_queries / pairs)
        tokens, targets, mask = mqar_batch(
            samples, ctx, pairs, mqar.vocab, np.random.default_rng([mqar.test_seed, ctx, pairs])
        )
        accuracy.setdefault(str(ctx), {})[str(pairs)] = mqar_accuracy_eager(trained, tokens, targets, mask)
        queries.setdefault(str(ctx), {})[str(pairs)] = int(mask.sum())
    every = max(1, len(losses) // 50)  # the loss curve, thinned to ~50 points
    return {
        "model": model_name(arm, width),
        "arm": arm,
        "width": width,
        "lr": lr,
        "seed": seed,
        "family": architecture_family(cfg),
        "attn_layers": list(cfg.attn_layers),
        "accuracy": accuracy,
        "queries": queries,
        "chance": mqar_chance(mqar.vocab),
        "final_loss": float(np.mean(losses[-20:])),
        "losses": [[i, round(v, 4)] for i, v in enumerate(losses) if i % every == 0 or i == len(losses) - 1],
        "bytes_per_sequence": {str(c): sequence_bytes(cfg, c)["total_bytes"] for c in mqar.contexts},
        "train_seconds": round(train_seconds, 3),
        "eval_seconds": round(time.perf_counter() - start - train_seconds, 3),
        "steps": mqar.steps,
        "computed": cell_fingerprint(mqar, cfg, lr, seed),
    }


def training(mqar: MqarSection, lr: float) -> MqarTraining:
    return MqarTraining(
        steps=mqar.steps,
        batch_size=mqar.batch_size,
        seq_len=mqar.seq_len,
        top_pairs=mqar.train_pairs,
        muon_lr=lr,
        adamw_lr=lr * mqar.adamw_lr_ratio,
        warmup_steps=mqar.warmup_steps,
    )


def cell_fingerprint(mqar: MqarSection, cfg: ModelConfig, lr: float, seed: int) -> dict:
    """Everything a cell's figures are a function of: the model, its training, its test set and seed."""
    return {
        "model": cfg.to_dict(),
        "training": dataclasses.asdict(training(mqar, lr)),
        "seed": seed,
        "test": {"contexts": mqar.contexts, "pairs": mqar.pairs, "queries": mqar.test_queries, "seed": mqar.test_seed},
    }


def same_computation(mqar: MqarSection, arm_model: ModelConfig, width: int, lr: float, seed: int, other: dict) -> bool:
    """Whether another cell's figures are this cell's: the same model, training, test and seed (a shallow
    MQAR model can give two arms the same pattern, e.g. both hybrids at 2 layers). Training is deterministic
    for a given computation, so such a cell is reused, not trained twice."""
    return other.get("computed") == cell_fingerprint(mqar, protocol_model_config(mqar, arm_model, width), lr, seed)


# --------------------------------------------------------------------------- statistics


def standard_error(values: list[float], queries: int) -> float:
    """The error of a mean over seeds: the spread across seeds (sample standard deviation over
    sqrt(seeds)), never below the binomial error of the pooled queries (so three seeds that all
    score 1.0 still carry the error their finite test set allows)."""
    k = len(values)
    spread = statistics.stdev(values) / math.sqrt(k) if k > 1 else math.inf
    return max(spread, binomial_se(sum(values) / k, k * queries))


def binomial_se(p: float, n: int) -> float:
    """The standard error of an accuracy p over n queries, floored at 1/n's (p of 0 or 1 still has one)."""
    return math.sqrt(max(p * (1 - p), 1.0 / n) / n)


def estimate(values: list[float], queries: int) -> dict:
    """{mean, se, seeds, queries}: one figure with its error."""
    return {
        "mean": sum(values) / len(values),
        "se": standard_error(values, queries),
        "seeds": list(values),
        "queries": queries,
    }


def differs(a: dict, b: dict) -> float:
    """a's mean minus b's, in units of their combined standard error (a z score)."""
    spread = math.hypot(a["se"], b["se"])
    return (a["mean"] - b["mean"]) / spread if spread > 0 else math.copysign(math.inf, a["mean"] - b["mean"])


def differs_paired(a: dict, b: dict) -> float:
    """a minus b for the same models (seed by seed: one model tested on two cells), in units of the
    standard error of the per-seed differences (never below the two cells' binomial errors combined):
    the seed-to-seed spread that both share cancels, as a paired test's does."""
    diffs = [x - y for x, y in zip(a["seeds"], b["seeds"], strict=True)]
    k, mean = len(diffs), sum(diffs) / len(diffs)
    binomial = math.hypot(*(binomial_se(e["mean"], k * e["queries"]) for e in (a, b)))
    spread = max(statistics.stdev(diffs) / math.sqrt(k) if k > 1 else math.inf, binomial)
    return mean / spread


def _grid_mean(cell: dict) -> float:
    values = [v for row in cell["accuracy"].values() for v in row.values()]
    return sum(values) / len(values)


def summarize(mqar: MqarSection, cells: list[dict]) -> dict:
    """Per model: every learning rate's results (the mean over seeds of each test cell, and the
    mean over test cells that ranks the rates), the best rate, and at that rate each test cell as
    {mean, se, seeds, queries}. A model missing a seed or a rate of the grid is an InputError."""
    by_model: dict[str, dict[float, dict[int, dict]]] = {}
    for cell in cells:
        by_model.setdefault(cell["model"], {}).setdefault(float(cell["lr"]), {})[int(cell["seed"])] = cell
    out = {}
    for model in models(mqar):
        rates = by_model.get(model, {})
        missing = [
            cell_name(model, lr, s) for lr in mqar.lrs for s in mqar.seeds if int(s) not in rates.get(float(lr), {})
        ]
        if missing:
            raise InputError(f"mqar: cells not run: {', '.join(missing)} (run `cd compare && dvc repro`)")
        per_rate = {}
        for lr in mqar.lrs:
            seeds = [rates[float(lr)][int(s)] for s in mqar.seeds]
            per_rate[f"{lr:g}"] = {
                "score": sum(_grid_mean(c) for c in seeds) / len(seeds),
                "accuracy": {
                    ctx: {p: sum(c["accuracy"][ctx][p] for c in seeds) / len(seeds) for p in row}
                    for ctx, row in seeds[0]["accuracy"].items()
                },
                "final_loss": [c["final_loss"] for c in seeds],
            }
        best = max(mqar.lrs, key=lambda lr: per_rate[f"{lr:g}"]["score"])  # the first of equals: the grid's order
        seeds = [rates[float(best)][int(s)] for s in mqar.seeds]
        first = seeds[0]
        for c in seeds:
            if c["queries"] != first["queries"]:
                raise InputError(f"mqar: {model}'s seeds were tested on different query counts (mixed settings)")
        accuracy = {
            ctx: {p: estimate([c["accuracy"][ctx][p] for c in seeds], first["queries"][ctx][p]) for p in row}
            for ctx, row in first["accuracy"].items()
        }
        out[model] = {
            "arm": first["arm"],
            "width": first["width"],
            "family": first["family"],
            "attn_layers": first["attn_layers"],
            "best_lr": best,
            # a best rate at an end of the grid may not be the model's optimum: the grid does not bracket it
            "best_lr_at_grid_edge": len(mqar.lrs) > 1 and best in (min(mqar.lrs), max(mqar.lrs)),
            "lrs": per_rate,
            "accuracy": accuracy,
            "bytes_per_sequence": first["bytes_per_sequence"],
            "chance": first["chance"],
            "train_seconds": [c["train_seconds"] for c in seeds],
        }
    return out


# --------------------------------------------------------------------------- the validity gate


def validity_gate(mqar: MqarSection, summary: dict) -> dict:
    """The known result, reproduced before any verdict: {passed, checks: [{check, passed, detail}]}.

    1. all-attention solves the reference cell (mqar.seq_len tokens, mqar.reference_pairs pairs, the
       widest width): accuracy >= mqar.attention_min (Zoology finds attention solving MQAR at every
       width it tried; a narrower model's figures are reported, not gated);
    2. a pure GLA falls as the pairs grow: at every width, accuracy at the most pairs is below the
       fewest by more than mqar.significance_se standard errors of the per-seed differences (a paired
       test: each seed's model is tested at both counts), at the reference length;
    3. a pure GLA rises with width: at the reference cell, its widest model beats its narrowest by
       more than that many standard errors."""
    z, ref_ctx, ref_pairs = mqar.significance_se, str(mqar.seq_len), str(mqar.reference_pairs)
    checks = []

    def check(name: str, passed: bool, detail: str) -> None:
        checks.append({"check": name, "passed": bool(passed), "detail": detail})

    def cell(model: str, ctx: str, pairs: str) -> dict:
        return summary[model]["accuracy"][ctx][pairs]

    def shown(e: dict) -> str:
        return f"{e['mean']:.3f} ± {e['se']:.3f} (seeds {', '.join(f'{v:.3f}' for v in e['seeds'])})"

    widest = max(s["width"] for s in summary.values())
    softmax = [m for m, s in summary.items() if s["family"] == "softmax" and s["width"] == widest]
    if not softmax:
        check("attention solves the reference cell", False, "no all-attention model in mqar.models")
    for m in softmax:
        e = cell(m, ref_ctx, ref_pairs)
        check(
            "attention solves the reference cell",
            e["mean"] >= mqar.attention_min,
            f"{m} at {ref_ctx} tokens, {ref_pairs} pairs: {shown(e)} against >= {mqar.attention_min}",
        )
    gla = sorted((s["width"], m) for m, s in summary.items() if s["family"] == "gla")
    pairs = sorted({int(p) for m in summary for p in summary[m]["accuracy"][ref_ctx]})
    if not gla:
        check("GLA falls as the pairs grow", False, "no pure GLA model in mqar.models")
    for _, m in gla:
        few, many = cell(m, ref_ctx, str(pairs[0])), cell(m, ref_ctx, str(pairs[-1]))
        score = differs_paired(few, many)
        check(
            "GLA falls as the pairs grow",
            len(pairs) > 1 and score > z,
            f"{m} at {ref_ctx} tokens: {pairs[0]} pairs {shown(few)}, {pairs[-1]} pairs {shown(many)} "
            f"({score:.2f} standard errors of the per-seed differences, needs > {z:g})",
        )
    if len(gla) < 2:
        check("GLA rises with width", False, f"needs pure GLA at two widths in mqar.models, has {[m for _, m in gla]}")
    else:
        (_, narrow), (_, wide) = gla[0], gla[-1]
        a, b = cell(wide, ref_ctx, ref_pairs), cell(narrow, ref_ctx, ref_pairs)
        score = differs(a, b)
        check(
            "GLA rises with width",
            score > z,
            f"at {ref_ctx} tokens, {ref_pairs} pairs: {wide} {shown(a)} vs {narrow} {shown(b)} "
            f"({score:.2f} standard errors apart, needs > {z:g})",
        )
    failed = [c for c in checks if not c["passed"]]
    reason = "; ".join(f"{c['check']}: failed, {c['detail']}" for c in failed)
    return {"passed": not failed, "checks": checks, "reason": reason}


# --------------------------------------------------------------------------- equal state bytes


def layer_kinds(cfg: ModelConfig) -> tuple[str, ...]:
    """Each layer's kind: gla, gdn (Gated DeltaNet) or attn."""
    return tuple(
        "attn" if i in cfg.attn_layers else "gdn" if i in cfg.gdn_layers else "gla" for i in range(cfg.n_layers)
    )


def matched_state(mqar: MqarSection, summary: dict, arm_models: dict[str, ModelConfig]) -> list[dict]:
    """Which fixed-state family buys more recall per byte: every model with Gated DeltaNet layers
    beside the model of the same width whose GDN layers are GLA layers instead (pure GDN against pure
    GLA, GDN + attention against GLA + attention at the same attention layers), where the two hold
    the same serving bytes per sequence at every test length (the protocol's GDN layer has a GLA
    layer's key and value widths and heads). Per test cell: GDN's mean minus GLA's, that difference in
    standard errors (seed spread included) and a verdict at mqar.significance_se. Two GLA arms that are
    one model at mqar.layers (both hybrids at 2 layers) are paired once, with the first of them."""
    kinds = {
        name: layer_kinds(protocol_model_config(mqar, arm_models[s["arm"]], s["width"])) for name, s in summary.items()
    }
    out, seen = [], set()
    for name, s in summary.items():
        if "gdn" not in kinds[name]:
            continue
        as_gla = tuple("gla" if k == "gdn" else k for k in kinds[name])
        for other, o in summary.items():
            key = (name, as_gla)
            if kinds[other] != as_gla or o["width"] != s["width"] or key in seen:
                continue
            if o["bytes_per_sequence"] != s["bytes_per_sequence"]:
                continue  # not a like-for-like pair: its bytes differ
            seen.add(key)
            cells: dict[str, dict[str, dict]] = {}
            for ctx, row in s["accuracy"].items():
                for pairs, e in row.items():
                    b = o["accuracy"][ctx][pairs]
                    z = differs(e, b)
                    verdict = "indistinguishable" if abs(z) <= mqar.significance_se else "above" if z > 0 else "below"
                    cells.setdefault(ctx, {})[pairs] = {"difference": e["mean"] - b["mean"], "z": z, "verdict": verdict}
            out.append(
                {
                    "gdn": name,
                    "gla": other,
                    "width": s["width"],
                    "bytes_per_sequence": s["bytes_per_sequence"],
                    "cells": cells,
                }
            )
    return out


# --------------------------------------------------------------------------- the frontier


def frontier(summary: dict) -> list[dict]:
    """The recall-versus-state points: one per model and test cell, its accuracy (mean ± se over
    seeds) against its serving bytes per sequence at that length (state, plus K/V where it has
    attention layers)."""
    points = []
    for model, s in summary.items():
        for ctx, row in s["accuracy"].items():
            for pairs, e in row.items():
                points.append(
                    {
                        "model": model,
                        "arm": s["arm"],
                        "family": s["family"],
                        "width": s["width"],
                        "context": int(ctx),
                        "pairs": int(pairs),
                        "bytes_per_sequence": s["bytes_per_sequence"][ctx],
                        "accuracy": e["mean"],
                        "se": e["se"],
                    }
                )
    return sorted(points, key=lambda p: (p["context"], p["pairs"], p["bytes_per_sequence"]))
