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
