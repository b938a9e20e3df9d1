"""The architecture comparison's table (`laplace compare`, compare/dvc.yaml's `table` stage): every
arm's figures (laplace.pipeline.compare) as one row each, the headline sentence, the pick by the
champion rule, the plots, and (track) MLflow: one parent run, a child run per arm. Its own module so
that the arms' stage does not depend on the table's code (or MLflow's): a change here reruns the
table only."""

from __future__ import annotations

import math
from pathlib import Path

from laplace.config import Config
from laplace.errors import InputError
from laplace.evals.mqar_protocol import differs
from laplace.fileio import atomic_write_json
from laplace.pipeline.compare import ARCH_FIGURES, COMPARE_DIR, arm_figures, arm_paths, check_arms
from laplace.pipeline.compare_mqar import format_protocol, protocol_file
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


def ruler_by_length(ruler: dict) -> dict[str, float]:
    """RULER per length: the mean score over the tasks that ran (each task's own score is kept beside)."""
    by_length: dict[str, list[float]] = {}
    for result in ruler.values():
        if result.get("run"):
            for length, score in (result.get("score") or {}).items():
                by_length.setdefault(length, []).append(score)
    return {n: _mean(v) for n, v in sorted(by_length.items(), key=lambda kv: int(kv[0]))}


def read_protocol(paths: Paths) -> dict:
    """The MQAR protocol's summary (compare/mqar/protocol.json, the `mqar` stage)."""
    import json

    path = protocol_file(paths)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        raise InputError(
            f"no MQAR protocol in {path}: run `cd compare && dvc repro` (or `laplace mqar` after its cells)"
        ) from None


def arm_recall(protocol: dict, arm: str) -> dict:
    """The arm's MQAR protocol figures, by model: {ARM-wWIDTH: {width, best_lr, accuracy}}."""
    return {
        name: {"width": m["width"], "best_lr": m["best_lr"], "accuracy": m["accuracy"]}
        for name, m in protocol["models"].items()
        if m["arm"] == arm
    }


def table_row(arm: str, figures: dict, table_contexts: list[int], protocol: dict | None = None) -> dict:
    """One row of the comparison table, from one arm's figures (and its MQAR protocol figures)."""
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
        "recall_verdict": probes.get("recall_verdict") or {},
        "mqar": arm_recall(protocol, arm) if protocol else {},
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


def _cell(row: dict, width: int, ctx: str, pairs: str) -> dict:
    """An arm's MQAR estimate at one width and test cell; a figure without its error or query count is an
    InputError (the pick never guesses a count)."""
    for name, m in row["mqar"].items():
        if m["width"] == width:
            e = m["accuracy"].get(ctx, {}).get(pairs)
            if not e or any(e.get(k) is None for k in ("mean", "se", "queries", "seeds")):
                raise InputError(
                    f"MQAR protocol: {name} has no mean, error, seeds and query count at {pairs} pairs, {ctx} tokens: "
                    "rerun `cd compare && dvc repro`"
                )
            return e
    raise InputError(f"MQAR protocol: arm {row['arm']} has no model at width {width}: rerun `cd compare && dvc repro`")


def _shown(e: dict) -> str:
    return f"{e['mean']:.2f} ± {e['se']:.2f}"


def _not_measured(protocol: dict) -> str | None:
    gate = protocol["gate"]
    return (
        None if gate["passed"] else f"recall not measured: the MQAR protocol's validity gate failed ({gate['reason']})"
    )


def headline(rows: dict, protocol: dict, memory_context: int) -> str:
    """The trade in one sentence, from the MQAR protocol at its widest width and reference cell: each
    hybrid against pure GLA and softmax, a difference stated only where it exceeds the protocol's
    significance (`indistinguishable` otherwise), the share of the GLA-softmax gap only where that gap
    is itself significant, and its serving bytes against GLA's and softmax's."""
    if reason := _not_measured(protocol):
        return reason
    fam = {r["family"]: r for r in rows.values()}
    gla, soft = fam.get("gla"), fam.get("softmax")
    if gla is None or soft is None:
        return "the comparison needs a gla and a softmax arm to state the trade"
    z = protocol["significance_se"]
    width = max(m["width"] for m in protocol["models"].values())
    ctx, pairs = str(protocol["reference"]["context"]), str(protocol["reference"]["pairs"])
    g, s = _cell(gla, width, ctx, pairs), _cell(soft, width, ctx, pairs)

    def versus(a: dict, b: dict, name: str) -> str:
        score = differs(a, b)
        if abs(score) <= z:
            return f"indistinguishable from {name}"
        return f"{'above' if score > 0 else 'below'} {name} by {abs(a['mean'] - b['mean']):.2f} ({abs(score):.1f} SE)"

    key = str(memory_context)
    gap = differs(s, g)
    where = f"MQAR at width {width}, {pairs} pairs in {ctx} tokens (best learning rate each, mean ± SE over seeds)"
    parts = [f"{where}: {gla['arm']} {_shown(g)}, {soft['arm']} {_shown(s)} ({versus(s, g, gla['arm'])})"]
    for arm, row in rows.items():
        if row["family"] != "hybrid":
            continue
        h = _cell(row, width, ctx, pairs)
        text = f"{arm} {_shown(h)}: {versus(h, g, gla['arm'])}, {versus(h, s, soft['arm'])}"
        if gap > z:
            text += f", {(h['mean'] - g['mean']) / (s['mean'] - g['mean']):.0%} of the gap closed"
        mine, base, top = (r["bytes_per_sequence"].get(key) for r in (row, gla, soft))
        if mine and base and top:
            text += f", for {mine / base:.1f}x {gla['arm']}'s serving bytes at {memory_context}"
            text += f" ({top / mine:.1f}x less than {soft['arm']})"
        parts.append(text)
    return "; ".join(parts + _equal_state(protocol, width, ctx, pairs))


def _equal_state(protocol: dict, width: int, ctx: str, pairs: str) -> list[str]:
    """The headline's recall-per-byte sentences: each Gated DeltaNet model against the GLA model of the
    same state bytes (the protocol's `matched_state`) at `width` and the reference cell."""
    out = []
    for pair in protocol.get("matched_state", []):
        if pair["width"] != width:
            continue
        a, b = (protocol["models"][pair[k]]["accuracy"][ctx][pairs] for k in ("gdn", "gla"))
        d = pair["cells"][ctx][pairs]
        verdict = (
            "indistinguishable"
            if d["verdict"] == "indistinguishable"
            else f"{d['verdict']} by {abs(d['difference']):.2f} ({abs(d['z']):.1f} SE)"
        )
        out.append(
            f"at equal state ({pair['bytes_per_sequence'][ctx]:,} B per sequence) {pair['gdn']} {_shown(a)} vs "
            f"{pair['gla']} {_shown(b)}: {verdict}"
        )
    return out


def pick(rows: dict, protocol: dict, memory_context: int, candidates: list[str] | None = None) -> dict:
    """The comparison's choice: the arm with the smallest serving bytes per sequence at
    `memory_context` whose MQAR protocol accuracy is not significantly below the best arm's in any test
    cell at any width (more than the protocol's `significance_se` standard errors, seed spread
    included); `candidates`: only these arms, e.g. one family. Returns {arm, reason}; no pick where
    the protocol's validity gate failed."""
    if reason := _not_measured(protocol):
        return {"arm": None, "reason": reason}
    names = candidates or list(rows)
    z, key = protocol["significance_se"], str(memory_context)
    widths = sorted({m["width"] for m in protocol["models"].values()})
    cells = sorted(
        {(c, p) for m in protocol["models"].values() for c, row in m["accuracy"].items() for p in row},
        key=lambda cp: (int(cp[0]), int(cp[1])),
    )
    why = {}
    for w in widths:
        for ctx, pairs in cells:
            est = {a: _cell(rows[a], w, ctx, pairs) for a in names}
            best = max(names, key=lambda a: est[a]["mean"])
            for a in names:
                score = differs(est[best], est[a])
                if a != best and score > z:
                    why.setdefault(a, []).append(
                        f"{_shown(est[a])} vs {best}'s {_shown(est[best])} at width {w}, {pairs} pairs in {ctx} "
                        f"tokens ({score:.1f} SE, {est[a]['queries']:,} queries x {len(est[a]['seeds'])} seeds)"
                    )
    ok = [a for a in names if a not in why]
    if not ok:  # each arm is significantly below another somewhere: no arm is as good as the best everywhere
        shown = "; ".join(f"{a} ({w[0]})" for a, w in why.items())
        return {"arm": None, "reason": f"every arm is significantly below another in some test cell: {shown}"}
    chosen = min(ok, key=lambda a: rows[a]["bytes_per_sequence"].get(key) or math.inf)
    reason = (
        f"the smallest serving bytes per sequence at {memory_context} "
        f"({rows[chosen]['bytes_per_sequence'].get(key):,} B) among the arms whose MQAR accuracy is not "
        f"significantly below the best (more than {z:g} standard errors) in any test cell at any width"
    )
    if why:
        reason += "; left out: " + "; ".join(
            f"{a} ({'; '.join(w[:2])}{'; ...' if len(w) > 2 else ''})" for a, w in why.items()
        )
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


def uninformative_columns(rows: dict, train_steps: int) -> dict[str, str]:
    """The LM arms' recall columns that compare nothing: recall@N where no arm's recall suite is above
    chance at N (probes' verdicts), ruler@N where every arm scored 0. {column: why}."""
    out = {}
    lengths = sorted({n for r in rows.values() for n in r["recall"]}, key=int)
    for n in lengths:
        verdicts = [r["recall_verdict"].get(n) for r in rows.values()]
        if all(v is not None and "none above chance" in v for v in verdicts):
            out[f"recall@{n}"] = f"no arm above chance after {train_steps} training steps"
    for n in sorted({n for r in rows.values() for n in r.get("ruler", {})}, key=int):
        if all((r.get("ruler", {}).get(n) or 0.0) == 0.0 for r in rows.values()):
            out[f"ruler@{n}"] = f"every arm scored 0 after {train_steps} training steps"
    return out


def build_table(cfg: Config, paths: Paths) -> dict:
    """compare/table.json: the table's rows, the MQAR protocol, the headline, the overall pick and one per
    family, and the LM columns that are not informative at this training budget."""
    from laplace.pipeline.compare import arm_config

    c = cfg.compare
    configs = check_arms(cfg)
    protocol = read_protocol(paths)
    rows = {arm: table_row(arm, arm_figures(paths, arm), c.table_contexts, protocol) for arm in configs}
    memory_context = 8192 if 8192 in c.memory_contexts else max(c.memory_contexts)
    families: dict[str, list[str]] = {}
    for arm, row in rows.items():
        families.setdefault(row["family"], []).append(arm)
    steps = arm_config(cfg, next(iter(configs))).train.steps
    return {
        "arms": rows,
        "mqar": protocol,
        "headline": headline(rows, protocol, memory_context),
        "pick": pick(rows, protocol, memory_context),
        "family_picks": {f: pick(rows, protocol, memory_context, arms) for f, arms in families.items()},
        "not_informative": uninformative_columns(rows, steps),
        "memory_context": memory_context,
        "laplace_3b": laplace_3b_bytes(memory_context),
    }


def _fmt(v, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def format_table(table: dict, table_contexts: list[int]) -> str:
    rows = table["arms"]
    lengths = sorted({n for r in rows.values() for n in r["recall"]}, key=int)
    ruler = sorted({n for r in rows.values() for n in r.get("ruler", {})}, key=int)
    mem = str(table["memory_context"])
    muted = table.get("not_informative") or {}
    protocol = table["mqar"]
    width = max(m["width"] for m in protocol["models"].values())
    ref_ctx, ref_pairs = str(protocol["reference"]["context"]), str(protocol["reference"]["pairs"])
    mqar_col = f"mqar {ref_pairs}p@{ref_ctx} w{width}"

    def col(name: str) -> str:  # a column that compares nothing is marked, its line below says why
        return f"({name})" if name in muted else name

    head = (
        ["arm", "family", "params", "val loss"]
        + [col(f"recall@{n}") for n in lengths]
        + [col(f"ruler@{n}") for n in ruler]
        + [mqar_col]
        + [f"B/seq@{mem}"]
        + [f"ms/tok@{c}" for c in table_contexts]
        + ["tok/s", "compiles"]
    )
    body = []
    for r in rows.values():
        e = next((m["accuracy"][ref_ctx][ref_pairs] for m in r["mqar"].values() if m["width"] == width), None)
        body.append(
            [r["arm"], r["family"], _fmt(r["parameters"], ","), _fmt(r["val_loss"], ".3f")]
            + [_fmt(r["recall"].get(n), ".2f") for n in lengths]
            + [_fmt(r.get("ruler", {}).get(n), ".2f") for n in ruler]
            + [_shown(e) if e else "-"]
            + [_fmt(r["bytes_per_sequence"].get(mem), ",")]
            + [_fmt(r["decode_ms_per_token"].get(str(c)), ".2f") for c in table_contexts]
            + [_fmt(r["output_tokens_per_s"], ".0f"), _fmt(r["compiles_while_serving"], "d")]
        )
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(b, widths)) for b in body]
    for name, why in muted.items():
        lines.append(f"({name})  not informative at this training budget: {why}; shown, not compared")
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
    lines.append("MQAR protocol (best learning rate per model, mean ± SE over seeds):")
    lines += ["  " + line for line in format_protocol(protocol).splitlines()]
    p = table["pick"]
    lines.append(f"headline    {table['headline']}")
    lines.append(f"pick        {p['arm'] or 'none'}: {p['reason']}")
    return "\n".join(lines)


def plot_rows(table: dict) -> dict[str, list[dict]]:
    """DVC plot data (compare/plots/*.json), one line (`series`) per arm (the protocol's plots are the
    `mqar` stage's)."""
    rows = table["arms"]

    def series(key: str, y: str) -> list[dict]:
        out = []
        for order, (arm, r) in enumerate(rows.items()):
            out += [
                {"context": int(n), y: v, "series": arm, "order": order} for n, v in r[key].items() if v is not None
            ]
        return sorted(out, key=lambda row: (row["order"], row["context"]))

    return {
        "recall": series("recall", "accuracy"),
        "bytes": series("bytes_per_sequence", "bytes"),
        "decode": series("decode_ms_per_token", "ms_per_token"),
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
