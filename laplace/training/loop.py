"""The training loop, top to bottom: data, model, optimizer, schedule, eval, checkpoints.

Written for torchrun from the start (rank and world size come from the environment;
the sampler slices a global batch by rank), runs on one process as is: a one-rank
process group. The model is built on the meta device and sharded with FSDP2 over all
ranks before it is materialised and initialised on the training device, so no rank
ever holds all of it (laplace.training.distributed.shard_model); Muon and AdamW step
the shards (laplace.optim.sharded). On CPU in fp32 eager mode a run stopped at step k
and resumed at the same world size is bit-identical to an uninterrupted one: the
sampler needs no state (the batch is a function of seed and step) and the checkpoint
holds every tensor the next step reads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from laplace.config import Config
from laplace.data.sampler import sample_batch, validation_batches
from laplace.data.shards import SPLITS, data_digests, open_split, read_manifest, verify_share
from laplace.errors import ConfigError, DataError, InputError
from laplace.model.lm import LaplaceLM
from laplace.runtime import compile_backend, compile_static, keep_cpu_allocations, resolve_device, set_threads
from laplace.training import checkpoint as ckpt
from laplace.training import distributed, lifecycle
from laplace.training.activation_checkpoint import apply_activation_checkpointing
from laplace.training.schedule import lr_scale

log = logging.getLogger(__name__)


class TrainingDiverged(InputError):
    """The loss became NaN or inf; the last good checkpoint is kept and nothing is exported."""


# Train knobs that change what is logged or saved, never the weights.
_BOOKKEEPING = {"eval_every", "eval_batches", "log_every", "checkpoint_every", "keep_checkpoints", "async_checkpoint"}
# Where and how the run executes: the same weights come out (up to rounding) on any of these,
# so a checkpoint resumes across world sizes, node counts, devices and compile settings.
# Activation checkpointing and gradient accumulation are of this kind too: they change how much
# is held at once, not the step's arithmetic (the same global batch, the same mean loss).
_LAUNCH = {
    "nproc_per_node",
    "nnodes",
    "node_rank",
    "rdzv_endpoint",
    "rdzv_id",
    "max_restarts",
    "device",
    "threads",
    "compile",
    "activation_checkpoint",
    "grad_accum_steps",
}


def run_fingerprint(cfg: Config, model_cfg, manifest: dict) -> str:
    """Hash of everything that decides the trained weights: a checkpoint resumes only the run it
    came from (same data, model, schedule and optimizers). Launch knobs are left out, and so is
    muon.comm (both strategies compute the same update); the data enter through the sha256
    their manifest lists, so no data file is read here."""
    train_knobs = {k: v for k, v in dataclasses.asdict(cfg.train).items() if k not in _BOOKKEEPING | _LAUNCH}
    muon = {k: v for k, v in dataclasses.asdict(cfg.muon).items() if k != "comm"}
    blob = json.dumps(
        {
            "seed": cfg.seed,
            "model": model_cfg.architecture(),  # model.kernel is how, not what: left out like _LAUNCH
            "train": train_knobs,
            "adamw": dataclasses.asdict(cfg.adamw),
            "muon": muon,
            "data": data_digests(manifest),
            "init": init_digest(cfg.model.init),
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def init_digest(init: str) -> str | None:
    """sha256 of model.init's weights, from its manifest (verified when the weights are loaded)."""
    if not init:
        return None
    from laplace import manifest as manifests

    found, reason = manifests.read_manifest(Path(init), "export")
    if found is None:
        raise ConfigError(f"model.init: {reason}")
    return found["files"]["model.safetensors"]["sha256"]


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def evaluate(model, batches, group: distributed.Group) -> float:
    """Mean validation loss over `batches` (global batches: each rank evaluates its slice and
    the ranks average, so every rank returns the same value)."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=group.device)
    for x, y in batches:
        per_rank = x.shape[0] // group.world
        rows = slice(group.rank * per_rank, (group.rank + 1) * per_rank)
        total += cross_entropy(model(x[rows].to(group.device)), y[rows].to(group.device)).detach()
    model.train(was_training)
    return float(distributed.all_mean(total / max(1, len(batches))))


def accumulate_gradients(model, x: torch.Tensor, y: torch.Tensor, micro_batches: int) -> torch.Tensor:
    """Forward and backward of this rank's rows `x`, `y` in `micro_batches` equal slices; returns
    the mean loss (detached). Each slice's loss is scaled by 1/micro_batches, so the summed
    gradients are those of the whole slice's mean loss. FSDP2 reduce-scatters only after the
    last slice (set_requires_gradient_sync): until then each rank adds into its unsharded
    gradients, which stay allocated in the reduce dtype (laplace plan counts them); the
    optimizer, and so the Muon exchange, then steps once."""
    total = torch.zeros((), device=x.device)
    for i, (xs, ys) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches))):
        if micro_batches > 1:
            model.set_requires_gradient_sync(i == micro_batches - 1)
        loss = cross_entropy(model(xs), ys) / micro_batches
        loss.backward()
        total += loss.detach()
    return total


@dataclass
class TrainResult:
    metrics: dict
    history: list[dict] = field(default_factory=list)
    checkpoint: Path | None = None


def check_inputs(cfg: Config, data_dir: Path, world: int):
    """What can be rejected before any rank trains, cheaply (sizes, no checksums): the tokenized
    data's manifest and splits, the model against the tokenizer, the batch against the world
    size. Returns (data manifest, model config). The train stage runs it before it launches
    torchrun; every rank runs it again and the ranks agree on the verdict."""
    t = cfg.train
    manifest = read_manifest(data_dir)
    model_cfg = cfg.model_config(vocab_size=manifest["vocab_size"])
    if manifest["vocab_size"] > model_cfg.vocab_size:
        raise ConfigError(
            f"model.vocab_size: tokenizer vocab {manifest['vocab_size']} is larger than model.vocab_size "
            f"{model_cfg.vocab_size}"
        )
    if cfg.model.init:
        check_init_tokenizer(cfg.model.init, manifest)
    if t.batch_size % world:
        raise ConfigError(f"train.batch_size {t.batch_size} is not divisible by the world size {world}")
    if (t.batch_size // world) % t.grad_accum_steps:
        raise ConfigError(
            f"train.grad_accum_steps {t.grad_accum_steps} does not divide each rank's {t.batch_size // world} "
            f"sequences (train.batch_size {t.batch_size} over {world} ranks)"
        )
    for split in SPLITS:
        tokens = open_split(data_dir, split, verify=False)
        if len(tokens) < t.seq_len + 1:
            raise DataError(
                f"{Path(data_dir) / split}: {len(tokens)} tokens, fewer than train.seq_len+1="
                f"{t.seq_len + 1}: lower train.seq_len or use more data"
            )
    return manifest, model_cfg


def check_init_tokenizer(init: str, manifest: dict) -> None:
    """The data must be tokenized with the init's own tokenizer: ids mean nothing across tokenizers."""
    from laplace.model.export import read_export_config

    wanted = read_export_config(Path(init))["tokenizer_sha256"]
    if manifest.get("tokenizer_sha256") != wanted:
        raise ConfigError(
            f"model.init: {init} was trained with another tokenizer than the tokenized data's: "
            f"set tokenizer.from={init} and tokenize again"
        )


def load_init_weights(model: LaplaceLM, init: str) -> None:
    """model.init's weights into `model` in place, each rank reading only the rows FSDP2 gave it
    (safetensors slices: a rank never holds a whole parameter it does not own)."""
    from safetensors import safe_open

    from laplace import manifest as manifests
    from laplace.sharding import local_rows

    ok, reason = manifests.verify(Path(init), "export")  # every byte as the export wrote it
    if not ok:
        raise ConfigError(f"model.init: {reason}")
    with safe_open(str(Path(init) / "model.safetensors"), framework="pt") as f, torch.no_grad():
        names = set(f.keys())
        for name, p in model.named_parameters():
            if name not in names:
                if name == "lm_head.weight" and model.cfg.tie_embeddings:
                    continue
                raise ConfigError(f"model.init: {init} has no tensor {name!r}")
            local, first = local_rows(p)
            if local.numel():
                local.copy_(f.get_slice(name)[first : first + local.shape[0]])


def open_data(data_dir: Path, group: distributed.Group):
    """The train and val token splits, memory-mapped. Each shard's sha256 is checked once per job
    (the shards are spread over the ranks), and every rank learns the verdict: no rank reads the
    whole corpus just to hash it."""
    train_tokens, val_tokens = open_split(data_dir, "train"), open_split(data_dir, "val")
    problem = verify_share([train_tokens, val_tokens], group.rank, group.world)
    distributed.raise_together(DataError(problem) if problem else None, group.device)
    return train_tokens, val_tokens


def build_model(
    model_cfg, mesh, device: torch.device, t, seed: int, init: str = "", muon_comm: str = "alltoall"
) -> LaplaceLM:
    """The model on meta, each block activation-checkpointed as train.activation_checkpoint says,
    then compiled if asked (one static graph shared by every block), sharded with FSDP2 over
    `mesh` (torchtitan's order), then materialised on `device` and initialised there: each
    rank allocates and initialises only its own rows (LaplaceLM.reset_parameters gives the
    weights a single process would get from the same seed). With `init` (model.init) the rows
    are then read from that export instead."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = LaplaceLM(model_cfg)
    apply_activation_checkpointing(model, t.activation_checkpoint)
    if t.compile:
        for block in model.blocks:
            compile_static(block, compile_backend(device))
    ignored = None
    if distributed.owner_reduce_applies(muon_comm, t.precision):  # the Muon matrices stay whole
        from laplace.optim.muon import route_parameters

        ignored = {p for _, p in route_parameters(model)["muon"]}
    distributed.shard_model(model, mesh, t.precision, ignored)
    model.to_empty(device=device)
    model.reset_parameters()
    if init:
        load_init_weights(model, init)
    return model


def train(
    cfg: Config,
    data_dir: Path,
    run_dir: Path,
    *,
    resume: bool = True,
    stop_at_step: int | None = None,
    on_log: Callable[[dict], None] | None = None,
    before_step: Callable[[int, torch.nn.Module, object], None] | None = None,
    progress: bool = True,
) -> TrainResult:
    """Train cfg.model on the tokenized data in `data_dir`, checkpointing into `run_dir`.

    Runs in a process group of any size (torchrun's, or a one-rank group): each rank takes
    its slice of the global batch; parameters, gradients and optimizer state are sharded
    (FSDP2, laplace.optim.sharded); checkpoints are torch.distributed.checkpoint.
    `stop_at_step` ends the run early after that step's checkpoint (used to test resume).
    `on_log` receives each logged row (step, loss, lr, tokens_per_s, val_loss when evaluated).
    `before_step(step, model, optimizer)` runs before each step (profiling, fault injection
    and state inspection in tests).
    """
    set_threads(cfg.train.threads)  # in each rank too: torchrun's OMP_NUM_THREADS says the same (stage_train)
    device = resolve_device(cfg.train.device)
    if device.type == "cpu":
        keep_cpu_allocations()
    group = distributed.join(device)
    try:
        trainer = Trainer(cfg, Path(data_dir), Path(run_dir), group, on_log=on_log, before_step=before_step)
        with lifecycle.stop_on_sigterm():
            return trainer.fit(resume=resume, stop_at_step=stop_at_step, progress=progress)
    finally:
        distributed.leave(group)


def _duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class Trainer:
    """One training run on this rank, its state on one object (torchtitan's Trainer shape):
    __init__ checks the inputs and builds the data, the model and the optimizer; `fit` resumes
    from the last verified checkpoint, then runs `train_step` per step, logging, evaluating and
    checkpointing as train: says, and returns the run's figures. Every rank runs the same calls
    in the same order: the collectives (loss mean, evaluation, stop and save verdicts) line up."""

    def __init__(
        self,
        cfg: Config,
        data_dir: Path,
        run_dir: Path,
        group: distributed.Group,
        *,
        on_log: Callable[[dict], None] | None = None,
        before_step: Callable[[int, torch.nn.Module, object], None] | None = None,
    ):
        from torch.distributed.device_mesh import init_device_mesh

        from laplace.optim.muon_adamw import MuonAdamW

        self.cfg, self.t, self.group, self.device = cfg, cfg.train, group, group.device
        self.on_log, self.before_step = on_log, before_step
        t = self.t
        distributed.check_shared_storage(data_dir, run_dir, group)
        error, manifest, model_cfg = None, None, None
        try:
            manifest, model_cfg = check_inputs(cfg, data_dir, group.world)
        except InputError as exc:
            error = exc
        distributed.raise_together(error, group.device)
        self.model_cfg = model_cfg
        self.train_tokens, val_tokens = open_data(data_dir, group)
        self.val_batches = validation_batches(val_tokens, t.batch_size, t.seq_len, t.eval_batches)

        mesh = init_device_mesh(group.device.type, (group.world,))
        self.model = build_model(model_cfg, mesh, group.device, t, cfg.seed, cfg.model.init, cfg.muon.comm)
        # train.compile on CUDA also compiles the Muon update (the LR a tensor: the schedule never
        # recompiles). Not on CPU: there Inductor's OpenMP loops over many small tensors measured
        # slower than eager when the cores were shared (bench/RESULTS.md), and eager is not launch-bound.
        backend = compile_backend(group.device) if t.compile and group.device.type == "cuda" else None
        self.optimizer = MuonAdamW(self.model, t.lr, cfg.adamw, cfg.muon, compile_backend=backend)

        self.run_dir, self.ckpt_root = run_dir, run_dir / "checkpoints"
        self.fingerprint = run_fingerprint(cfg, model_cfg, manifest)
        self.tokens_per_step = t.batch_size * t.seq_len
        self.start_step, self.history = 0, []
        self.saver: ckpt.Checkpointer | None = None
        self.save_seconds = None  # the last save's duration: does one fit in what is left of a SIGTERM's grace?
        self.last_path: Path | None = None
        # throughput: this run's steps and tokens (fit starts the clocks), and the log window's
        self.steps_run, self.run_tokens, self.run_start = 0, 0, 0.0
        self.window_tokens, self.window_start = 0, 0.0

    # ----------------------------------------------------------------------- checkpoints

    def restore(self, resume: bool) -> None:
        """Resume from the last verified checkpoint of this run; another run's checkpoints (params
        or data changed) are kept one generation back, and training starts over."""
        group, device, ckpt_root = self.group, self.device, self.ckpt_root
        found = ckpt.latest_verified(ckpt_root, device) if resume else None
        # Rank 0 reads the verdict and every rank gets it, before rank 0 moves anything.
        foreign = group.is_main and found is not None
        foreign = foreign and json.loads((found / "trainer.json").read_text()).get("fingerprint") != self.fingerprint
        if found is not None and distributed.broadcast_int(int(foreign), device):
            if group.is_main:
                previous = self.run_dir / "previous"
                shutil.rmtree(previous, ignore_errors=True)
                ckpt_root.rename(previous)
                log.warning(
                    "checkpoints in %s belong to another run (settings or data changed); moved to %s, "
                    "training from step 0",
                    ckpt_root,
                    previous,
                )
            distributed.barrier()
            found = None
        if found is not None:
            trainer = ckpt.load_sharded(found, self.model, self.optimizer.optimizers)
            self.start_step, self.history = int(trainer["step"]), list(trainer.get("history", []))
            if group.is_main:
                log.info(
                    "resumed from %s (step %d, saved at world size %s, now %d)",
                    found,
                    self.start_step,
                    trainer.get("world_size"),
                    group.world,
                )

    def save(self, step: int) -> Path:
        start = time.perf_counter()
        trainer = {
            "history": self.history,
            "model_config": self.model_cfg.architecture(),
            "fingerprint": self.fingerprint,
        }
        self.last_path = self.saver.save(step, self.model, self.optimizer.optimizers, trainer)
        self.save_seconds = time.perf_counter() - start
        return self.last_path

    def checkpoint(self, done: int, stop_at_step: int | None) -> None:
        """Save when train.checkpoint_every (or the run's end) says so, or when SIGTERM (or Ctrl-C) asks the
        job to stop and a save still fits in its grace; then stop with TrainingStopped if asked."""
        t, device = self.t, self.device
        self.saver.finish_if_written()  # an async checkpoint every rank has written goes into place now
        stopping = lifecycle.stop_requested(device)  # collective: every rank stops after the same step
        if done % t.checkpoint_every == 0 or done == t.steps or (stop_at_step is not None and done >= stop_at_step):
            if not stopping or lifecycle.time_to_save(self.save_seconds, device):
                self.save(done)
        elif stopping and lifecycle.time_to_save(self.save_seconds, device):
            self.save(done)
        if stopping:
            self.saver.close()  # an async write is put in place before the job ends
            kept = f"checkpoint {self.last_path.name} kept" if self.last_path is not None else "no checkpoint written"
            name, signum = lifecycle.stop_signal()
            raise lifecycle.TrainingStopped(f"stopped by {name} after step {done}; {kept}; rerun to resume", signum)

    # ----------------------------------------------------------------------- one step

    def train_step(self, step: int) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Forward, backward and the optimizer step of global step `step` (0-based) on this rank's
        slice of the batch: (the loss averaged over ranks, the gradient norm, the LR scale)."""
        t, group, device = self.t, self.group, self.device
        if self.before_step is not None:
            self.before_step(step, self.model, self.optimizer)
        scale = lr_scale(step, t)
        self.optimizer.set_lr_scale(scale)
        x, y = sample_batch(self.train_tokens, step, t.batch_size, t.seq_len, self.cfg.seed, group.rank, group.world)
        loss = accumulate_gradients(self.model, x.to(device), y.to(device), t.grad_accum_steps)
        mean_loss = distributed.all_mean(loss)  # every rank sees the same value, so every rank stops together
        if not torch.isfinite(mean_loss):
            raise TrainingDiverged(
                f"loss is {mean_loss.item()} at step {step + 1}; last good checkpoint kept in {self.ckpt_root}"
            )
        grad_norm = self.optimizer.step(max_grad_norm=t.grad_clip)
        self.optimizer.zero_grad()
        self.steps_run += 1
        self.window_tokens += self.tokens_per_step
        self.run_tokens += self.tokens_per_step
        return mean_loss, grad_norm, scale

    def record(self, done: int, mean_loss: torch.Tensor, grad_norm: torch.Tensor, scale: float, bar) -> None:
        """The history row of step `done` when train.log_every or train.eval_every asks for one
        (evaluated on the validation batches for the latter), its log line and on_log."""
        t = self.t
        row = None
        if done % t.log_every == 0 or done == t.steps:
            now = time.perf_counter()
            row = {
                "step": done,
                "loss": mean_loss.item(),
                "lr_scale": scale,
                "grad_norm": grad_norm.item(),
                "tokens_per_s": self.window_tokens / max(now - self.window_start, 1e-9),
            }
            self.window_start, self.window_tokens = now, 0
            bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}")
        if done % t.eval_every == 0 or done == t.steps:
            row = row or {"step": done, "loss": mean_loss.item(), "lr_scale": scale}
            row["val_loss"] = evaluate(self.model, self.val_batches, self.group)
        if row is None:
            return
        self.history.append(row)
        if self.group.is_main:
            # a plain line per logged step, whatever the front door: log files show no progress bar
            eta = (time.perf_counter() - self.run_start) / self.steps_run * (t.steps - done)
            rate = f" | {row['tokens_per_s']:,.0f} tok/s" if "tokens_per_s" in row else ""
            log.info(
                "step %d/%d loss %.4f%s%s | ETA %s",
                done,
                t.steps,
                row["loss"],
                f" val_loss {row['val_loss']:.4f}" if "val_loss" in row else "",
                rate,
                _duration(eta),
            )
            if self.on_log:
                self.on_log(row)

    # ----------------------------------------------------------------------- the run

    def fit(self, *, resume: bool = True, stop_at_step: int | None = None, progress: bool = True) -> TrainResult:
        t, group = self.t, self.group
        self.restore(resume)
        self.saver = ckpt.Checkpointer(self.ckpt_root, t.keep_checkpoints, self.device, asynchronous=t.async_checkpoint)
        if self.start_step == 0 and not self.history:
            self.history.append({"step": 0, "val_loss": evaluate(self.model, self.val_batches, group)})
            if self.on_log and group.is_main:
                self.on_log(self.history[-1])

        bar = tqdm(
            range(self.start_step, t.steps),
            initial=self.start_step,
            total=t.steps,
            disable=not progress or not group.is_main or not sys.stderr.isatty(),  # log files get the lines
            desc="train",
            unit="step",
            dynamic_ncols=True,
        )
        self.window_start, self.window_tokens = time.perf_counter(), 0
        self.run_start, self.run_tokens, self.steps_run = time.perf_counter(), 0, 0
        self.optimizer.meter.reset()
        self.model.train()
        for step in bar:
            mean_loss, grad_norm, scale = self.train_step(step)
            done = step + 1
            self.record(done, mean_loss, grad_norm, scale, bar)
            self.checkpoint(done, stop_at_step)
            if stop_at_step is not None and done >= stop_at_step:
                break
        bar.close()
        self.saver.close()
        return self.result()

    def result(self) -> TrainResult:
        """The run's figures (metrics/train.json), its history and its last checkpoint."""
        from laplace.optim.exchange import traffic_metrics

        run_seconds = time.perf_counter() - self.run_start
        traffic = (
            traffic_metrics(self.optimizer.meter.gather(device=self.device), self.steps_run) if self.steps_run else {}
        )
        history = self.history
        evals = [h for h in history if "val_loss" in h]
        losses = [h for h in history if "loss" in h]
        metrics = {
            "steps": history[-1]["step"] if history else 0,
            "params": self.model.num_parameters(),  # DTensor shapes are global
            "tokens_per_step": self.tokens_per_step,
            "world_size": self.group.world,
            "threads": torch.get_num_threads(),  # train.threads as this rank ran
            "muon_comm": self.optimizer.muon.comm,  # owner_reduce falls back to alltoall under bf16
            "muon_ns_dtype": str(self.optimizer.muon.ns_dtype).removeprefix("torch."),  # muon.ns_dtype as resolved
            "val_loss_initial": evals[0]["val_loss"] if evals else None,
            "val_loss": evals[-1]["val_loss"] if evals else None,
            "val_ppl": math.exp(min(evals[-1]["val_loss"], 50)) if evals else None,
            "train_loss": losses[-1]["loss"] if losses else None,
            "tokens_per_s": self.run_tokens / run_seconds if self.run_tokens else None,
            "train_seconds_this_run": run_seconds,
            "resumed_from_step": self.start_step,
            "traffic": traffic,
        }
        last_path = self.last_path
        if last_path is None and (latest := ckpt.list_checkpoints(self.ckpt_root)):
            last_path = latest[0][1]
        return TrainResult(metrics=metrics, history=history, checkpoint=last_path)
