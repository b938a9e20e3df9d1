"""Plots of stage results: DVC plot data (JSON rows) and PNG images (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402

from laplace.fileio import atomic_open, atomic_write_json  # noqa: E402


def write_rows(path: Path, rows: list[dict]) -> None:
    """A DVC plot data file: a JSON list of flat records."""
    atomic_write_json(path, rows)


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
            ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post",
                    label=policy, color=POLICY_COLORS.get(policy))
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
    fig, axes = plt.subplots(len(policies), 1, figsize=(10, 2.4 * len(policies)), sharex=False, squeeze=False)
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
        counts = [sum(1 for s in traces[policy][workload]["steps"] if s[0] == "decode" and s[3] == w)
                  for w in widths]
        ax.bar([j + i * bar for j in range(len(widths))], counts, width=bar, label=policy,
               color=POLICY_COLORS.get(policy))
    ax.set_xticks([j + bar * (len(policies) - 1) / 2 for j in range(len(widths))], [str(w) for w in widths])
    ax.set_xlabel("decode width (rows computed)")
    ax.set_ylabel("steps")
    ax.set_title(f"decode widths ({workload})")
    ax.legend()
    save_figure(fig, path)
