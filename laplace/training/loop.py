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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from laplace.config import Config
from laplace.data.sampler import sample_batch, validation_batches
from laplace.data.shards import data_digests, open_split, read_manifest, verify_share
from laplace.errors import ConfigError, DataError, InputError
from laplace.model.lm import LaplaceLM
from laplace.runtime import keep_cpu_allocations, resolve_device
from laplace.training import checkpoint as ckpt
from laplace.training.schedule import lr_scale

log = logging.getLogger(__name__)


class TrainingDiverged(InputError):
    """The loss became NaN or inf; the last good checkpoint is kept and nothing is exported."""


# Train knobs that change what is logged or saved, never the weights.
_BOOKKEEPING = {"eval_every", "eval_batches", "log_every", "checkpoint_every", "keep_checkpoints", "nproc_per_node"}


def run_fingerprint(cfg: Config, model_cfg, manifest: dict) -> str:
    """Hash of everything that decides the trained weights: a checkpoint resumes only the run it
    came from (same data, model, schedule and optimizers)."""
    train_knobs = {k: v for k, v in dataclasses.asdict(cfg.train).items() if k not in _BOOKKEEPING}
    blob = json.dumps(
        {
            "seed": cfg.seed,
            "model": model_cfg.to_dict(),
            "train": train_knobs,
            "adamw": dataclasses.asdict(cfg.adamw),
            "muon": dataclasses.asdict(cfg.muon),
            "data": data_digests(manifest),
        },
        sort_keys=True,
    )
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

    Runs in a process group of any size (torchrun's, or a one-rank group): each rank takes
    its slice of the global batch; gradients are reduce-scattered and the Muon/AdamW state
    is sharded (laplace.optim.sharded); checkpoints are torch.distributed.checkpoint.
    `stop_at_step` ends the run early after that step's checkpoint (used to test resume).
    `on_log` receives each logged row (step, loss, lr, tokens_per_s, val_loss when evaluated).
    `before_step(step, model)` runs before each step (profiling, fault injection in tests).
    """
    from torch.distributed.device_mesh import init_device_mesh

    from laplace.optim.sharded import ShardedMuonAdamW
    from laplace.training import distributed

    t = cfg.train
    device = resolve_device(t.device)
    if device.type == "cpu":
        keep_cpu_allocations()
    manifest = read_manifest(data_dir)
    model_cfg = cfg.model_config(vocab_size=manifest["vocab_size"])
    if manifest["vocab_size"] > model_cfg.vocab_size:
        raise ConfigError(
            f"model.vocab_size: tokenizer vocab {manifest['vocab_size']} is larger than model.vocab_size "
            f"{model_cfg.vocab_size}"
        )
    group = distributed.join(device)
    try:
        if t.batch_size % group.world:
            raise ConfigError(f"train.batch_size {t.batch_size} is not divisible by the world size {group.world}")
        mesh = init_device_mesh(device.type, (group.world,))
        train_tokens = open_split(data_dir, "train")
        val_tokens = open_split(data_dir, "val")
        # each shard's sha256 is read once per job (by one rank), and every rank learns the verdict
        problem = verify_share([train_tokens, val_tokens], group.rank, group.world)
        if distributed.all_mean(torch.tensor(float(bool(problem)), device=device)) > 0:
            raise DataError(problem or "a token shard failed its sha256 check on another rank (see its log)")
        val_batches = validation_batches(val_tokens, t.batch_size, t.seq_len, t.eval_batches)

        torch.manual_seed(cfg.seed)
        model = LaplaceLM(model_cfg).to(device)
        optimizer = ShardedMuonAdamW(model, t.lr, cfg.adamw, cfg.muon, comm=cfg.muon.comm)
        return _loop(
            cfg,
            model,
            optimizer,
            group,
            mesh,
            device,
            manifest,
            model_cfg,
            train_tokens,
            val_batches,
            Path(run_dir),
            resume,
            stop_at_step,
            on_log,
            before_step,
            progress,
        )
    finally:
        distributed.leave(group)


def _loop(
    cfg,
    model,
    optimizer,
    group,
    mesh,
    device,
    manifest,
    model_cfg,
    train_tokens,
    val_batches,
    run_dir,
    resume,
    stop_at_step,
    on_log,
    before_step,
    progress,
) -> TrainResult:
    from laplace.optim.sharded import traffic_metrics
    from laplace.training.distributed import all_mean, barrier

    t = cfg.train
    ckpt_root = run_dir / "checkpoints"
    fingerprint = run_fingerprint(cfg, model_cfg, manifest)
    start_step, history = 0, []
    found = ckpt.latest_verified(ckpt_root) if resume else None
    if found is not None and json.loads((found / "trainer.json").read_text()).get("fingerprint") != fingerprint:
        # Another run's checkpoints (params or data changed): keep them one generation back, start over.
        if group.is_main:
            previous = run_dir / "previous"
            shutil.rmtree(previous, ignore_errors=True)
            ckpt_root.rename(previous)
            log.warning(
                "checkpoints in %s belong to another run (settings or data changed); moved to %s, training from step 0",
                ckpt_root,
                previous,
            )
        barrier()
        found = None
    if found is not None:
        trainer = ckpt.load_sharded(found, model, optimizer, mesh)
        start_step, history = int(trainer["step"]), list(trainer.get("history", []))
        optimizer.set_adamw_steps(start_step)
        if group.is_main:
            log.info(
                "resumed from %s (step %d, saved at world size %s, now %d)",
                found,
                start_step,
                trainer.get("world_size"),
                group.world,
            )

    step_fn = torch.compile(model, fullgraph=True, dynamic=False) if t.compile else model

    def save(step: int) -> Path:
        trainer = {"history": history, "model_config": model_cfg.to_dict(), "fingerprint": fingerprint}
        return ckpt.save_sharded(ckpt_root, step, model, optimizer, trainer, t.keep_checkpoints, mesh)

    if start_step == 0 and not history:
        history.append({"step": 0, "val_loss": evaluate(model, val_batches, t.precision, device)})
        if on_log and group.is_main:
            on_log(history[-1])

    tokens_per_step = t.batch_size * t.seq_len
    last_path = None
    bar = tqdm(
        range(start_step, t.steps),
        initial=start_step,
        total=t.steps,
        disable=not progress or not group.is_main,
        desc="train",
        unit="step",
        dynamic_ncols=True,
    )
    window_start, window_tokens = time.perf_counter(), 0
    run_start, run_tokens, steps_run = time.perf_counter(), 0, 0
    optimizer.meter.reset()
    model.train()
    for step in bar:
        if before_step is not None:
            before_step(step, model)
        scale = lr_scale(step, t)
        optimizer.set_lr_scale(scale)
        x, y = sample_batch(train_tokens, step, t.batch_size, t.seq_len, cfg.seed, group.rank, group.world)
        x, y = x.to(device), y.to(device)
        with autocast_context(t.precision, device):
            loss = cross_entropy(step_fn(x), y)
        mean_loss = all_mean(loss)  # every rank sees the same value, so every rank stops together
        if not torch.isfinite(mean_loss):
            raise TrainingDiverged(
                f"loss is {mean_loss.item()} at step {step + 1}; last good checkpoint kept in {ckpt_root}"
            )
        loss.backward()
        grad_norm = optimizer.step(max_grad_norm=t.grad_clip)
        optimizer.zero_grad()
        done = step + 1
        steps_run += 1
        window_tokens += tokens_per_step
        run_tokens += tokens_per_step

        row = None
        if done % t.log_every == 0 or done == t.steps:
            elapsed = time.perf_counter() - window_start
            row = {
                "step": done,
                "loss": mean_loss.item(),
                "lr_scale": scale,
                "grad_norm": grad_norm,
                "tokens_per_s": window_tokens / max(elapsed, 1e-9),
            }
            window_start, window_tokens = time.perf_counter(), 0
            bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}")
        if done % t.eval_every == 0 or done == t.steps:
            row = row or {"step": done, "loss": mean_loss.item(), "lr_scale": scale}
            row["val_loss"] = evaluate(model, val_batches, t.precision, device)
        if row is not None:
            history.append(row)
            if group.is_main:
                # a plain line per logged step: visible in log files, where the progress bar is not
                log.info(
                    "step %d/%d loss %.4f%s",
                    done,
                    t.steps,
                    row["loss"],
                    f" val_loss {row['val_loss']:.4f}" if "val_loss" in row else "",
                )
                if on_log:
                    on_log(row)
        if done % t.checkpoint_every == 0 or done == t.steps or (stop_at_step is not None and done >= stop_at_step):
            last_path = save(done)
        if stop_at_step is not None and done >= stop_at_step:
            break
    bar.close()

    run_seconds = time.perf_counter() - run_start
    traffic = traffic_metrics(optimizer.meter.gather(), steps_run) if steps_run else {}
    evals = [h for h in history if "val_loss" in h]
    losses = [h for h in history if "loss" in h]
    metrics = {
        "steps": history[-1]["step"] if history else 0,
        "params": model.num_parameters(),
        "tokens_per_step": tokens_per_step,
        "world_size": group.world,
        "muon_comm": cfg.muon.comm,
        "val_loss_initial": evals[0]["val_loss"] if evals else None,
        "val_loss": evals[-1]["val_loss"] if evals else None,
        "val_ppl": math.exp(min(evals[-1]["val_loss"], 50)) if evals else None,
        "train_loss": losses[-1]["loss"] if losses else None,
        "tokens_per_s": run_tokens / run_seconds if run_tokens else None,
        "train_seconds_this_run": run_seconds,
        "resumed_from_step": start_step,
        "traffic": traffic,
    }
    if last_path is None and (latest := ckpt.list_checkpoints(ckpt_root)):
        last_path = latest[0][1]
    return TrainResult(metrics=metrics, history=history, checkpoint=last_path)
