"""Plots of stage results: DVC plot data (JSON rows) and PNG images (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

from laplace.fileio import atomic_open, atomic_write_json  # noqa: E402
from laplace.model.config import ModelConfig  # noqa: E402
from laplace.model.lm import kv_cache_bytes  # noqa: E402


def write_rows(path: Path, rows: list[dict]) -> None:
    """A DVC plot data file: a JSON list of flat records."""
    atomic_write_json(path, rows)


def series_rows(
    values: dict[str, dict[int, float]], *, x: str, y: str, chance: float | None = None, same_within: float = 0.005
) -> list[dict]:
    """DVC plot rows (`x`, `y`, `series`, `order`) of named series in the given order, with
    `chance` as one more series. Series whose values agree within `same_within` everywhere (three
    needle depths all at 0, or all at chance) become one series naming them all, so that every
    line drawn is one series a reader can see, never several hidden on top of each other.
    `order` keeps the legend in the given order (4, 8, 16 pairs), not sorted as strings."""
    named = dict(values)
    if chance is not None:
        named["chance"] = {c: chance for row in values.values() for c in row}
    groups: list[tuple[list[str], dict[int, float]]] = []
    for name, row in named.items():
        for names, first in groups:
            if first.keys() == row.keys() and all(abs(first[c] - row[c]) <= same_within for c in row):
                names.append(name)
                break
        else:
            groups.append(([name], row))
    rows = []
    for order, (names, row) in enumerate(groups):
        label = " = ".join(names)
        rows += [{x: c, y: row[c], "series": label, "order": order} for c in sorted(row)]
    return rows


def save_figure(fig, path: Path) -> None:
    with atomic_open(path) as f:
        fig.savefig(f, format="png", dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)


def training_curve(history: list[dict], path: Path) -> None:
    """Train loss per logged step and validation loss per evaluation, one PNG."""
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    train = [(h["step"], h["loss"]) for h in history if "loss" in h]
    val = [(h["step"], h["val_loss"]) for h in history if "val_loss" in h]
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1.2)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss", lw=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("training curve")
    save_figure(fig, path)


POLICY_COLORS = {"exact": "tab:red", "padded": "tab:green", "eager": "tab:blue"}


def latency_cdfs(traces: dict, workload: str, path: Path) -> None:
    """TTFT and end-to-end latency CDFs, one line per serving policy."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for policy, by_workload in traces.items():
        trace = by_workload.get(workload)
        if not trace:
            continue
        for ax, key in zip(axes, ("ttft", "e2e")):
            values = sorted(trace[key])
            ax.step(
                values,
                [(i + 1) / len(values) for i in range(len(values))],
                where="post",
                label=policy,
                color=POLICY_COLORS.get(policy),
            )
    for ax, title in zip(axes, ("time to first token", "end-to-end latency")):
        ax.set_xscale("log")
        ax.set_xlabel("seconds")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{title} ({workload})")
        ax.grid(alpha=0.3)
        ax.legend()
    save_figure(fig, path)


def step_timeline(traces: dict, workload: str, path: Path) -> None:
    """Duration of every engine step over (virtual) time, compile stalls marked."""
    policies = [p for p in traces if traces[p].get(workload)]
    fig, axes = plt.subplots(
        len(policies), 1, figsize=(10, 2.6 * len(policies)), sharex=False, squeeze=False, layout="constrained"
    )
    for ax, policy in zip(axes[:, 0], policies):
        steps = traces[policy][workload]["steps"]
        for kind, marker in (("decode", "."), ("prefill", "^")):
            pts = [(s[1], s[2]) for s in steps if s[0] == kind and not s[5]]
            if pts:
                ax.scatter(*zip(*pts), s=6, marker=marker, label=kind, color=POLICY_COLORS.get(policy))
        stalls = [(s[1], s[2]) for s in steps if s[5]]
        if stalls:
            ax.scatter(*zip(*stalls), s=40, marker="x", color="black", label="compile stall")
        ax.set_yscale("log")
        ax.set_ylabel("step seconds")
        ax.set_title(f"{policy} ({workload})")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("time since the first arrival (s)")
    save_figure(fig, path)


def width_histogram(traces: dict, workload: str, path: Path) -> None:
    """How often each decode width ran, per policy."""
    fig, ax = plt.subplots(figsize=(7, 3.6))
    policies = [p for p in traces if traces[p].get(workload)]
    widths = sorted({s[3] for p in policies for s in traces[p][workload]["steps"] if s[0] == "decode"})
    bar = 0.8 / max(1, len(policies))
    for i, policy in enumerate(policies):
        counts = [sum(1 for s in traces[policy][workload]["steps"] if s[0] == "decode" and s[3] == w) for w in widths]
        ax.bar(
            [j + i * bar for j in range(len(widths))], counts, width=bar, label=policy, color=POLICY_COLORS.get(policy)
        )
    ax.set_xticks([j + bar * (len(policies) - 1) / 2 for j in range(len(widths))], [str(w) for w in widths])
    ax.set_xlabel("decode width (rows computed)")
    ax.set_ylabel("steps")
    ax.set_title(f"decode widths ({workload})")
    ax.legend()
    save_figure(fig, path)


def memory_plot(report: dict, path: Path) -> None:
    """Bytes per sequence vs context: the GLA state (flat) and a same-size transformer's KV cache
    (linear), for the probed model and for Laplace 3B (log axes); next to it, measured RSS
    while decoding after each context."""
    measured = {int(c): v for c, v in (report.get("decode_rss_bytes") or {}).items()}
    kv_ctx = [int(c) for c in report.get("kv_bytes", {})]
    top = max(kv_ctx + list(measured) + [32768])
    contexts = [2**i for i in range(7, top.bit_length()) if 2**i <= top] + [top]
    contexts = sorted(set(contexts))
    fig, (ax, ax_rss) = plt.subplots(1, 2, figsize=(11, 4.0))
    for key, label, color in (
        ("model_config", "probed model", "tab:blue"),
        ("laplace_3b_config", "Laplace 3B", "tab:red"),
    ):
        cfg = ModelConfig(**report[key])
        state = report["state_bytes_measured"] if key == "model_config" else report["laplace_3b_state_bytes"]
        ax.plot(contexts, [state] * len(contexts), "-", color=color, label=f"{label}: GLA state")
        ax.plot(
            contexts,
            [kv_cache_bytes(cfg, c) for c in contexts],
            "--",
            color=color,
            label=f"{label}: transformer KV (bf16)",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("bytes per sequence")
    ax.set_title(f"3B: KV at 8,192 = {report['laplace_3b_state_vs_kv_8192']:.0f}x the state")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    if measured:
        xs = sorted(measured)
        ax_rss.plot(xs, [measured[c] / 2**20 for c in xs], "o-", color="tab:blue")
        ax_rss.set_ylim(0, max(measured.values()) / 2**20 * 1.2)
    ax_rss.set_xscale("log", base=2)
    ax_rss.set_xlabel("context before decoding (tokens)")
    ax_rss.set_ylabel("process RSS while decoding (MiB)")
    ratio = report.get("decode_rss_flat_ratio")
    ax_rss.set_title(f"decode memory vs context (max/min {ratio:.3f})" if ratio else "decode memory vs context")
    ax_rss.grid(alpha=0.3)
    save_figure(fig, path)


def accuracy_plot(result: dict, path: Path) -> None:
    """The trained MQAR model: accuracy vs context (a line per pair count) and vs pairs (a line
    per context), chance dashed."""
    grid = {int(c): {int(p): a for p, a in row.items()} for c, row in result["accuracy"].items()}
    contexts = sorted(grid)
    pairs = sorted({p for row in grid.values() for p in row})
    fig, (ax_ctx, ax_pairs) = plt.subplots(1, 2, figsize=(11, 4.0), sharey=True, layout="constrained")
    for p in pairs:
        xs = [c for c in contexts if p in grid[c]]
        ax_ctx.plot(xs, [grid[c][p] for c in xs], "o-", label=f"{p} pairs")
    for c in contexts:
        xs = sorted(grid[c])
        ax_pairs.plot(xs, [grid[c][p] for p in xs], "o-", label=f"context {c}")
    for ax in (ax_ctx, ax_pairs):
        if result.get("chance"):
            ax.axhline(result["chance"], color="gray", ls="--", lw=1, label="chance")
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_ctx.set_xlabel("context length (tokens)")
    ax_ctx.set_ylabel("MQAR accuracy")
    ax_pairs.set_xlabel("key-value pairs")
    if result.get("state_floats"):
        title = (
            f"MQAR, a GLA trained here on <= {result['train_pairs']} pairs at {result['train_seq_len']} "
            f"tokens (state {result['state_floats']:,} floats per sequence)"
        )
    else:
        title = "MQAR"
    fig.suptitle(title)
    save_figure(fig, path)


def comparison_plots(table: dict, out_dir: Path) -> None:
    """The architecture comparison (laplace compare): the exported models' recall suite per length, serving
    bytes per sequence and decode time against context, a line per arm (the MQAR protocol's frontier is
    the `mqar` stage's, `mqar_plots`)."""
    rows = table["arms"]

    def lines(key: str, title: str, ylabel: str, path: Path, logy: bool = False) -> None:
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for arm, r in rows.items():
            points = sorted((int(n), v) for n, v in r[key].items() if v is not None)
            if points:
                ax.plot(*zip(*points), marker="o", lw=1.4, label=f"{arm} ({r['family']})")
        ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        save_figure(fig, path)

    lines("recall", "recall suite of the exported models", "accuracy", out_dir / "recall_exported.png")
    lines("bytes_per_sequence", "serving bytes per sequence (state + K/V)", "bytes", out_dir / "bytes.png", True)
    lines("decode_ms_per_token", "decode time per token after a prompt", "ms per token", out_dir / "decode.png", True)


def mqar_plots(protocol: dict, out_dir: Path) -> None:
    """The MQAR protocol (laplace mqar): the recall-versus-state frontier (accuracy ± se over seeds
    against serving bytes per sequence, a panel per test cell, a marker per model, as the Based
    paper draws it) and each model's score per learning rate (the grid behind its best rate)."""
    points = protocol["frontier"]
    cells = sorted({(p["context"], p["pairs"]) for p in points})
    fig, axes = plt.subplots(1, len(cells), figsize=(4.2 * len(cells), 3.8), squeeze=False, sharey=True)
    families = sorted({p["family"] for p in points})
    colours = {f: f"C{i}" for i, f in enumerate(families)}
    for ax, (ctx, pairs) in zip(axes[0], cells):
        # models with the very same figures (two hybrids that are one model at this depth) share a point
        same: dict[tuple, list[dict]] = {}
        for p in (q for q in points if (q["context"], q["pairs"]) == (ctx, pairs)):
            same.setdefault((p["bytes_per_sequence"], p["accuracy"], p["se"]), []).append(p)
        for i, ((x, y, se), group) in enumerate(sorted(same.items())):
            family = group[0]["family"]
            ax.errorbar(x, y, yerr=se, fmt="o", color=colours[family], capsize=3, label=family)
            # labels stagger down, so points at the same height (every model at 1.00) stay readable
            ax.annotate("\n".join(p["model"] for p in group), (x, y), xytext=(4, -10 - 9 * (i % 3)), **_small)
        ax.set_xscale("log")
        ax.margins(x=0.3)
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_title(f"{pairs} pairs, {ctx} tokens")
        ax.set_xlabel("serving bytes per sequence")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("MQAR accuracy (best lr, mean ± se over seeds)")
    axes[0][0].set_ylim(-0.05, 1.05)
    handles, labels = axes[0][0].get_legend_handles_labels()
    by_family = dict(zip(labels, handles))  # one entry per family
    axes[0][0].legend(list(by_family.values()), list(by_family), fontsize=7, loc="upper left")
    save_figure(fig, out_dir / "mqar_frontier.png")
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for model, s in protocol["models"].items():
        rates = sorted((float(lr), r["score"]) for lr, r in s["lrs"].items())
        ax.plot(*zip(*rates), marker="o", lw=1.2, label=f"{model} (best {s['best_lr']:g})")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate (Muon)")
    ax.set_ylabel("MQAR accuracy, mean over test cells and seeds")
    ax.set_title("the learning-rate grid of each model")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save_figure(fig, out_dir / "mqar_lrs.png")


_small = {"textcoords": "offset points", "fontsize": 7}
