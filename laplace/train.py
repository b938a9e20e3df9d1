"""The training loop, top to bottom: data, model, optimizer, schedule, eval, checkpoints.

Written for torchrun from the start (rank and world size come from the environment;
the sampler slices a global batch by rank), runs on one process as is. On CPU in
fp32 eager mode a run stopped at step k and resumed is bit-identical to an
uninterrupted one: the sampler needs no state (the batch is a function of seed and
step) and the checkpoint holds every tensor the next step reads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from tqdm import tqdm

from laplace import checkpoint as ckpt
from laplace.config import Config, TrainSection
from laplace.data import open_split, read_manifest, sample_batch, validation_batches
from laplace.model.lm import LaplaceLM
from laplace.optim.muon import MuonAdamW
from laplace.runtime import resolve_device

log = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """The loss became NaN or inf; the last good checkpoint is kept and nothing is exported."""


def lr_scale(step: int, t: TrainSection) -> float:
    """Multiplier on the base learning rates: linear warmup, then cosine, WSD or constant."""
    if t.warmup_steps and step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    if t.schedule == "constant":
        return 1.0
    if t.schedule == "cosine":
        span = max(1, t.steps - t.warmup_steps)
        progress = min(1.0, (step - t.warmup_steps) / span)
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    # wsd: warmup, stable, then a linear decay over the last decay_fraction of the steps
    decay_steps = max(1, int(round(t.steps * t.decay_fraction)))
    decay_start = t.steps - decay_steps
    if step < decay_start:
        return 1.0
    return 1.0 - (1 - t.min_lr_ratio) * min(1.0, (step - decay_start + 1) / decay_steps)


# Train knobs that change what is logged or saved, never the weights.
_BOOKKEEPING = {"eval_every", "eval_batches", "log_every", "checkpoint_every", "keep_checkpoints", "nproc_per_node"}


def run_fingerprint(cfg: Config, model_cfg, manifest: dict) -> str:
    """Hash of everything that decides the trained weights: a checkpoint resumes only the run it
    came from (same data, model, schedule and optimizers)."""
    train_knobs = {k: v for k, v in dataclasses.asdict(cfg.train).items() if k not in _BOOKKEEPING}
    blob = json.dumps({
        "seed": cfg.seed, "model": model_cfg.to_dict(), "train": train_knobs,
        "adamw": dataclasses.asdict(cfg.adamw), "muon": dataclasses.asdict(cfg.muon),
        "data": {"tokenizer": manifest.get("tokenizer_sha256"),
                 "train": manifest.get("files", {}).get("train.bin", {}).get("sha256"),
                 "val": manifest.get("files", {}).get("val.bin", {}).get("sha256")},
    }, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def autocast_context(precision: str, device: torch.device):
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def evaluate(model, batches, precision: str, device: torch.device) -> float:
    was_training = model.training
    model.eval()
    total = 0.0
    for x, y in batches:
        with autocast_context(precision, device):
            total += cross_entropy(model(x.to(device)), y.to(device)).item()
    model.train(was_training)
    return total / max(1, len(batches))


@dataclass
class TrainResult:
    metrics: dict
    history: list[dict] = field(default_factory=list)
    checkpoint: Path | None = None


def train(
    cfg: Config,
    data_dir: Path,
    run_dir: Path,
    *,
    resume: bool = True,
    stop_at_step: int | None = None,
    on_log: Callable[[dict], None] | None = None,
    before_step: Callable[[int, torch.nn.Module], None] | None = None,
    progress: bool = True,
) -> TrainResult:
    """Train cfg.model on the tokenized data in `data_dir`, checkpointing into `run_dir`.

    `stop_at_step` ends the run early after that step's checkpoint (used to test resume).
    `on_log` receives each logged row (step, loss, lr, tokens_per_s, val_loss when evaluated).
    `before_step(step, model)` runs before each step (profiling, fault injection in tests).
    """
    t = cfg.train
    device = resolve_device(t.device)
    manifest = read_manifest(data_dir)
    model_cfg = cfg.model_config(vocab_size=manifest["vocab_size"])
    if manifest["vocab_size"] > model_cfg.vocab_size:
        raise ValueError(
            f"tokenizer vocab {manifest['vocab_size']} is larger than model.vocab_size {model_cfg.vocab_size}"
        )
    train_tokens = open_split(data_dir, "train", verify=True)
    val_tokens = open_split(data_dir, "val", verify=True)
    val_batches = validation_batches(val_tokens, t.batch_size, t.seq_len, t.eval_batches)

    torch.manual_seed(cfg.seed)
    model = LaplaceLM(model_cfg).to(device)
    optimizer = MuonAdamW(model, t.lr, cfg.adamw, cfg.muon)
    ckpt_root = Path(run_dir) / "checkpoints"

    fingerprint = run_fingerprint(cfg, model_cfg, manifest)
    start_step, history = 0, []
    found = ckpt.latest_checkpoint(ckpt_root) if resume else None
    if found is not None and found.trainer.get("fingerprint") != fingerprint:
        # Another run's checkpoints (params or data changed): keep them one generation back, start over.
        previous = Path(run_dir) / "previous"
        shutil.rmtree(previous, ignore_errors=True)
        ckpt_root.rename(previous)
        log.warning("checkpoints in %s belong to another run (settings or data changed); moved to %s, "
                    "training from step 0", ckpt_root, previous)
        found = None
    if found is not None:
        model.load_state_dict(found.model)
        optimizer.load_state_tensors(found.optimizer)
        start_step, history = found.step, list(found.trainer.get("history", []))
        log.info("resumed from %s (step %d)", found.path, start_step)

    step_fn = model
    if t.compile:
        step_fn = torch.compile(model, fullgraph=True, dynamic=False)

    def save(step: int) -> Path:
        trainer = {"history": history, "model_config": model_cfg.to_dict(), "fingerprint": fingerprint}
        return ckpt.save_checkpoint(
            ckpt_root, step, model.state_dict(), optimizer.state_tensors(), trainer, keep=t.keep_checkpoints
        )

    if start_step == 0 and not history:
        val0 = evaluate(model, val_batches, t.precision, device)
        history.append({"step": 0, "val_loss": val0})
        if on_log:
            on_log(history[-1])

    tokens_per_step = t.batch_size * t.seq_len
    last_path = None
    bar = tqdm(range(start_step, t.steps), initial=start_step, total=t.steps, disable=not progress,
               desc="train", unit="step", dynamic_ncols=True)
    window_start, window_tokens = time.perf_counter(), 0
    run_start, run_tokens = time.perf_counter(), 0
    model.train()
    for step in bar:
        if before_step is not None:
            before_step(step, model)
        scale = lr_scale(step, t)
        optimizer.set_lr_scale(scale)
        x, y = sample_batch(train_tokens, step, t.batch_size, t.seq_len, cfg.seed)
        x, y = x.to(device), y.to(device)
        with autocast_context(t.precision, device):
            loss = cross_entropy(step_fn(x), y)
        if not torch.isfinite(loss):
            raise TrainingDiverged(f"loss is {loss.item()} at step {step + 1}; last good checkpoint kept in {ckpt_root}")
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip or float("inf"))
        optimizer.step()
        optimizer.zero_grad()
        done = step + 1
        window_tokens += tokens_per_step
        run_tokens += tokens_per_step

        row = None
        if done % t.log_every == 0 or done == t.steps:
            elapsed = time.perf_counter() - window_start
            row = {"step": done, "loss": loss.item(), "lr_scale": scale, "grad_norm": grad_norm.item(),
                   "tokens_per_s": window_tokens / max(elapsed, 1e-9)}
            window_start, window_tokens = time.perf_counter(), 0
            bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}")
        if done % t.eval_every == 0 or done == t.steps:
            row = row or {"step": done, "loss": loss.item(), "lr_scale": scale}
            row["val_loss"] = evaluate(model, val_batches, t.precision, device)
        if row is not None:
            history.append(row)
            if on_log:
                on_log(row)
        if done % t.checkpoint_every == 0 or done == t.steps:
            last_path = save(done)
        if stop_at_step is not None and done >= stop_at_step:
            if last_path is None or not last_path.name.endswith(f"{done:06d}"):
                last_path = save(done)
            break
    bar.close()

    run_seconds = time.perf_counter() - run_start
    evals = [h for h in history if "val_loss" in h]
    losses = [h for h in history if "loss" in h]
    metrics = {
        "steps": history[-1]["step"] if history else 0,
        "params": model.num_parameters(),
        "tokens_per_step": tokens_per_step,
        "val_loss_initial": evals[0]["val_loss"] if evals else None,
        "val_loss": evals[-1]["val_loss"] if evals else None,
        "val_ppl": math.exp(min(evals[-1]["val_loss"], 50)) if evals else None,
        "train_loss": losses[-1]["loss"] if losses else None,
        "tokens_per_s": run_tokens / run_seconds if run_tokens else None,
        "train_seconds_this_run": run_seconds,
        "resumed_from_step": start_step,
    }
    if last_path is None and (latest := ckpt.list_checkpoints(ckpt_root)):
        last_path = latest[0][1]
    return TrainResult(metrics=metrics, history=history, checkpoint=last_path)
