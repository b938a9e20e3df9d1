"""The architecture comparison's table (`laplace compare`, compare/dvc.yaml's `table` stage): every
arm's figures (laplace.pipeline.compare) as one row each, the headline sentence, the pick by the
champion rule, the plots, and (track) MLflow: one parent run, a child run per arm. Its own module so
that the arms' stage does not depend on the table's code (or MLflow's): a change here reruns the
table only."""

from __future__ import annotations

import math
from pathlib import Path

from laplace.config import Config
from laplace.fileio import atomic_write_json
from laplace.pipeline.compare import ARCH_FIGURES, COMPARE_DIR, arm_figures, arm_paths, check_arms
from laplace.pipeline.layout import Paths


def comparison_plots_dir(paths: Paths) -> Path:
    return paths.root / COMPARE_DIR / "plots"


def table_file(paths: Paths) -> Path:
    """The table (`dvc metrics show` in compare/)."""
    return paths.root / COMPARE_DIR / "table.json"


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


def ruler_by_length(ruler: dict) -> dict[str, float]:
    """RULER per length: the mean score over the tasks that ran (each task's own score is kept beside)."""
    by_length: dict[str, list[float]] = {}
    for result in ruler.values():
        if result.get("run"):
            for length, score in (result.get("score") or {}).items():
                by_length.setdefault(length, []).append(score)
    return {n: _mean(v) for n, v in sorted(by_length.items(), key=lambda kv: int(kv[0]))}


def table_row(arm: str, figures: dict, table_contexts: list[int]) -> dict:
    """One row of the comparison table, from one arm's figures."""
    train, probes, arch = figures["train"], figures["probes"], figures[ARCH_FIGURES]
    ruler = arch.get("ruler") or {}
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
        "ruler": ruler_by_length(ruler),
        "ruler_tasks": {t: r.get("score") for t, r in ruler.items() if r.get("run")},
        "ruler_not_run": {t: r.get("reason") for t, r in ruler.items() if not r.get("run")},
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


# the article's shape and its hybrids, from the formula (nothing that size is trained here)
LAPLACE_3B = (
    "laplace-3b",
    "laplace-3b-hybrid-24to1",
    "laplace-3b-hybrid-7to1",
    "laplace-3b-hybrid-3to1",
    "laplace-3b-attn",
)


def laplace_3b_bytes(context: int) -> dict:
    """Bytes per sequence at `context` tokens of the laplace-3b presets (bf16), each against the
    all-attention preset (GQA, 8 kv heads) and the article's K/V cache (a 3B transformer's MHA,
    laplace.model.lm.kv_cache_bytes): ratios computed, not assumed."""
    from laplace.model.config import preset_model_config
    from laplace.model.lm import kv_cache_bytes, sequence_bytes

    configs = {name: preset_model_config(name) for name in LAPLACE_3B}
    total = {name: sequence_bytes(m, context)["total_bytes"] for name, m in configs.items()}
    mha = kv_cache_bytes(configs["laplace-3b"], context)
    return {
        "context": context,
        "article_kv_cache_bytes": mha,
        "presets": {
            name: {"bytes": b, "attention_over_this": total["laplace-3b-attn"] / b, "article_kv_over_this": mha / b}
            for name, b in total.items()
        },
    }


def build_table(cfg: Config, paths: Paths) -> dict:
    """compare/table.json: the table's rows, the headline, the overall pick and one per family."""
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
        "laplace_3b": laplace_3b_bytes(memory_context),
    }


def _fmt(v, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def format_table(table: dict, table_contexts: list[int]) -> str:
    rows = table["arms"]
    lengths = sorted({n for r in rows.values() for n in r["recall"]}, key=int)
    trained = sorted({n for r in rows.values() for n in r["recall_trained_mqar"]}, key=int)
    ruler = sorted({n for r in rows.values() for n in r.get("ruler", {})}, key=int)
    mem = str(table["memory_context"])
    head = (
        ["arm", "family", "params", "val loss"]
        + [f"recall@{n}" for n in lengths]
        + [f"mqar@{n}" for n in trained]
        + [f"ruler@{n}" for n in ruler]
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
            + [_fmt(r.get("ruler", {}).get(n), ".2f") for n in ruler]
            + [_fmt(r["bytes_per_sequence"].get(mem), ",")]
            + [_fmt(r["decode_ms_per_token"].get(str(c)), ".2f") for c in table_contexts]
            + [_fmt(r["output_tokens_per_s"], ".0f"), _fmt(r["compiles_while_serving"], "d")]
        )
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(b, widths)) for b in body]
    not_run: dict[str, tuple[list[str], str]] = {}  # task: (the arms, the first arm's reason), a line per task
    for r in rows.values():
        for task, why in (r.get("ruler_not_run") or {}).items():
            not_run.setdefault(task, ([], why))[0].append(r["arm"])
    for task, (arms, why) in not_run.items():
        lines.append(f"ruler       {task} not run on {', '.join(arms)}: {why}")
    if big := table.get("laplace_3b"):  # the formula's figures at the article's shape
        shown = ", ".join(
            f"{name} {v['bytes'] / 1e6:,.1f} MB ({v['article_kv_over_this']:.1f}x less than the article's K/V)"
            for name, v in big["presets"].items()
        )
        lines.append(f"3B formula  at {big['context']} tokens, bf16: {shown}")
    p = table["pick"]
    lines.append(f"headline    {table['headline']}")
    lines.append(f"pick        {p['arm'] or 'none'}: {p['reason']}")
    return "\n".join(lines)


def plot_rows(table: dict) -> dict[str, list[dict]]:
    """DVC plot data (compare/plots/*.json), one line (`series`) per arm."""
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
    """The `table` stage: compare/table.json, compare/plots/*.json and *.png, and (track) MLflow."""
    from laplace.pipeline.plots import comparison_plots, write_rows

    table = build_table(cfg, paths)
    out_dir = comparison_plots_dir(paths)
    data = plot_rows(table)
    for name, rows in data.items():
        write_rows(out_dir / f"{name}.json", rows)
    comparison_plots(table, out_dir)
    atomic_write_json(table_file(paths), table)
    if track:
        from laplace.tracking.compare import log_comparison

        # run ids change on every log: kept out of the metrics file DVC compares
        dirs = {arm: (arm_paths(paths, arm).metrics_dir, arm_paths(paths, arm).export_dir) for arm in table["arms"]}
        atomic_write_json(tracking_file(paths), log_comparison(cfg, paths.root, table, out_dir, dirs))
    return table


def tracking_file(paths: Paths) -> Path:
    return paths.root / COMPARE_DIR / "tracking.json"
