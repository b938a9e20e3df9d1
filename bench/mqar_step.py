"""Time per MQAR training step of the protocol's models, and what a whole protocol costs from it.

For each (arm, width) of a protocol (params.yaml's `mqar:`, or the GPU profile documented in
docs/architectures.md), the median seconds of one training step (forward, backward, clip, Muon +
AdamW) at the profile's batch and sequence length, measured after warmup steps; then the projection:
seconds per cell (steps x step time) and for the whole grid (x rates x seeds). The docs' estimate of
the GPU profile's time comes from this, on the device it names.

    .venv/bin/python bench/mqar_step.py                          # params.yaml's protocol, CPU
    .venv/bin/python bench/mqar_step.py --profile zoology --widths 64 128 --repeats 2   # the GPU profile's
    .venv/bin/python bench/mqar_step.py --profile zoology --device cuda                 # on a GPU
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_device_argument, emit, machine, median_seconds, prepare_device, print_table  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def zoology_profile() -> dict:
    """The `mqar:` block of docs/architectures.md's GPU profile (the YAML after its marker line)."""
    from laplace.pipeline.params import parse_yaml

    text = (ROOT / "docs" / "architectures.md").read_text()
    block = re.search(r"<!-- zoology-profile -->\n```yaml\n(.*?)```", text, re.S)
    if block is None:
        raise SystemExit("docs/architectures.md has no zoology-profile block")
    return parse_yaml(block.group(1))


def step_seconds(m, model_cfg, device: torch.device, repeats: int) -> float:
    """Median seconds of one MQAR training step of a fresh model of `model_cfg` (5 warmup steps)."""
    from laplace.config import AdamWSection, MuonSection
    from laplace.evals.mqar import IGNORE, _mixed_batch
    from laplace.model.lm import LaplaceLM
    from laplace.optim.muon_adamw import MuonAdamW

    model = LaplaceLM(model_cfg).to(device)
    optimizer = MuonAdamW(model, 0.001, AdamWSection(weight_decay=0.0), MuonSection(lr=0.001))
    rng = np.random.default_rng(0)

    def step():
        tokens, targets = _mixed_batch(m.batch_size, m.seq_len, m.train_pairs, m.vocab, rng)
        logits = model(tokens.to(device))
        loss = F.cross_entropy(logits.reshape(-1, m.vocab), targets.to(device).reshape(-1), ignore_index=IGNORE)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    return median_seconds(step, repeats, warmup=5, device=device)  # first steps: one-time setup (2.6 s vs 0.15 s)


def main(argv=None) -> int:
    from laplace.config import config_from_dict
    from laplace.evals.mqar_protocol import protocol_model_config
    from laplace.pipeline.compare_mqar import arm_models
    from laplace.pipeline.params import load_config

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_device_argument(ap)
    ap.add_argument("--profile", choices=("params", "zoology"), default="params")
    ap.add_argument("--widths", type=int, nargs="*", help="only these widths (default: the profile's)")
    ap.add_argument("--arms", nargs="*", help="only these arms (default: the profile's)")
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per model (after 5 warmup steps)")
    args = ap.parse_args(argv)
    device, _ = prepare_device(args.device)
    if args.profile == "zoology":
        cfg = config_from_dict({**load_config(ROOT / "params.yaml").to_dict(), **zoology_profile()})
    else:
        cfg = load_config(ROOT / "params.yaml")
    m = cfg.mqar
    archs = arm_models(cfg)
    rows, results = [], {}
    for arm in args.arms or m.arms:
        for width in args.widths or m.widths:
            model_cfg = protocol_model_config(m, archs[arm], width)
            seconds = step_seconds(m, model_cfg, device, args.repeats)
            cell = seconds * m.steps
            grid = cell * len(m.lrs) * len(m.seeds)
            results[f"{arm}-w{width}"] = {"step_s": seconds, "cell_s": cell, "grid_s": grid}
            rows.append([f"{arm}-w{width}", f"{seconds * 1000:.1f}", f"{cell / 60:.1f}", f"{grid / 3600:.2f}"])
    total = sum(r["grid_s"] for r in results.values())
    print(
        f"{args.profile} profile on {device}: batch {m.batch_size} x {m.seq_len} tokens, vocab {m.vocab}, "
        f"{m.layers} layers, {m.steps} steps, {len(m.lrs)} rates x {len(m.seeds)} seeds"
    )
    print_table(["model", "ms/step", "min/cell", "h/model (rates x seeds)"], rows)
    print(f"all models measured: {total / 3600:.2f} h of training on this device, one cell at a time")
    emit({"profile": args.profile, "models": results, "total_s": total, "machine": machine(device)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
