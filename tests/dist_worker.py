"""Run by torchrun from tests/test_distributed.py, on gloo, with a collective spy installed.

step PREFIX     a few training steps of the FSDP2 model with MuonAdamW (every Muon
                strategy, muon.comm), every rank on the whole batch and each rank on its slice of
                it. Rank 0 writes the final parameters, the traffic and the spy's report, and for
                the split batch every step's parameters and reduced gradient, gathered whole.
recompute PREFIX [PRECISION COMPILE]
                the same steps with train.activation_checkpoint none, full and selective; rank 0
                writes each mode's losses and every step's gradients, gathered whole.
accumulate PREFIX
                the same steps as one batch per rank, and as 4 micro-batches of a quarter of it
                (train.grad_accum_steps through loop.accumulate_gradients); rank 0 writes the
                losses, every step's parameters and gradients and the number of Muon exchanges.
train PREFIX CONFIG DATA RUN [STOP_AT_STEP]
                laplace.training.loop.train on a tokenized project (stopped after STOP_AT_STEP
                and its checkpoint, if given); at the first step it runs after a resume, every
                rank writes the optimizer state it holds, gathered whole; rank 0 writes the
                spy's report, the metrics and the history.

Several modes run in one launch with "+" between them (`step P1 + accumulate P2`), one after the
other in one process group: a launch's process start-ups are most of its cost.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from laplace.config import AdamWSection, MuonSection, TrainSection, config_from_dict
from laplace.model.config import preset_model_config
from laplace.optim.muon_adamw import MuonAdamW
from laplace.training import distributed
from laplace.training.loop import accumulate_gradients, build_model, cross_entropy, train

STEPS, VOCAB, GLOBAL_BATCH, SEED = 4, 300, 4, 11
# bf16 Newton-Schulz on every CPU: the runs are compared with torch.optim.Muon bit for bit
ADAMW_LR, MUON = 3e-3, MuonSection(lr=0.02, ns_dtype="bfloat16")
CLIP = 0.5  # low enough to clip at least once in the first steps
COMMS = ("owner_reduce", "alltoall", "allgather")


def model_config():
    return preset_model_config(
        "tiny",
        vocab_size=VOCAB,
        d_model=64,
        n_layers=2,
        n_heads=2,
        chunk_size=16,
        sub_chunk_size=8,
        gate_low_rank_dim=2,  # a 2-row matrix: at 4 ranks two of them hold no rows of it
    )


def batch(step: int, size: int = GLOBAL_BATCH):
    """The global batch of a step: the same on every rank, each rank trains on its slice."""
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (size, 33), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


class CollectiveSpy:
    """Wraps torch.distributed's collective functions (where our code, DTensor, DCP and FSDP2's
    all_gather_single / reduce_scatter_single calls land) and records every call whose tensors
    are off the expected device, fp64, or split unevenly."""

    NAMES = (
        "all_reduce",
        "broadcast",
        "reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_single",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "reduce_scatter_single",
        "all_to_all",
        "all_to_all_single",
        "gather",
        "scatter",
        "send",
        "recv",
        "isend",
        "irecv",
    )

    def __init__(self, device: torch.device):
        self.device = device
        self.violations: list[str] = []
        self.calls: dict[str, int] = {}
        for name in self.NAMES:
            original = getattr(c10d, name)
            wrapped = self._wrap(name, original)
            setattr(c10d, name, wrapped)
            setattr(dist, name, wrapped)

    def _tensors(self, value):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            for v in value:
                yield from self._tensors(v)

    def _wrap(self, name, original):
        def spy(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            tensors = [t for a in (*args, *kwargs.values()) for t in self._tensors(a)]
            for t in tensors:
                if t.device.type != self.device.type:
                    self.violations.append(f"{name}: a tensor on {t.device}, the parameters are on {self.device}")
                if t.dtype == torch.float64:
                    self.violations.append(f"{name}: an fp64 tensor")
            if name == "all_to_all_single":
                splits = [s for s in (kwargs.get("output_split_sizes"), kwargs.get("input_split_sizes")) if s]
                splits += [a for a in args[2:4] if isinstance(a, (list, tuple)) and a]
                if any(len(set(s)) > 1 for s in splits):
                    self.violations.append(f"{name}: uneven splits {splits}")
            if name in ("all_to_all", "all_gather", "reduce_scatter"):
                sizes = {t.numel() for a in args[:2] if isinstance(a, (list, tuple)) for t in self._tensors(a)}
                if len(sizes) > 1:
                    self.violations.append(f"{name}: tensors of unequal sizes {sorted(sizes)}")
            return original(*args, **kwargs)

        return spy

    def report(self) -> dict:
        return {"violations": sorted(set(self.violations)), "calls": self.calls}


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (a collective: every rank calls it), a plain tensor as it is."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _whole_parameters(model) -> dict[str, torch.Tensor]:
    return {n: _whole(p) for n, p in model.named_parameters()}


def _whole_gradients(model, muon) -> dict[str, torch.Tensor]:
    """Every gradient whole on every rank; with owner_reduce a Muon matrix's reduced gradient is
    on its owner alone, which broadcasts it."""
    out = {}
    for name, p in model.named_parameters():
        grad, owner = p.grad, muon.owner_of(p)
        if owner is not None and muon.group is not None:
            grad = grad if owner == muon.rank else torch.empty_like(p)
            dist.broadcast(grad, src=owner, group=muon.group)
        out[name] = _whole(grad)
    return out


def record_each_step(opt: MuonAdamW, model, records: list[dict]) -> None:
    """Make `opt` append, at each step, the parameters and the reduced gradients, whole, at the
    point MuonAdamW.step clips: after owner_reduce's reduce to the owners, before anything
    changes either. The step itself runs unchanged."""
    clip = opt.clip_grad_norm_

    def recording(max_norm: float):
        records.append({"params": _whole_parameters(model), "grads": _whole_gradients(model, opt.muon)})
        return clip(max_norm)

    opt.clip_grad_norm_ = recording


def per_step_tensors(records: list[dict]) -> dict[str, torch.Tensor]:
    """{"<step>/<params|grads>/<name>": tensor}, as tests/test_distributed.py reads them back."""
    return {
        f"{step}/{kind}/{name}": t.contiguous()
        for step, record in enumerate(records)
        for kind, named in record.items()
        for name, t in named.items()
    }


def step_mode(prefix: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    group = distributed.join(torch.device("cpu"))
    spy = CollectiveSpy(group.device)
    mesh = init_device_mesh("cpu", (group.world,))
    out = {}
    # split: each rank trains on its slice of the global batch, gradients clipped (the real thing);
    # same: every rank trains on the whole batch, no clipping (the optimizer alone: bitwise)
    for mode, comm in [(mode, comm) for mode in ("split", "same") for comm in COMMS]:
        model = build_model(model_config(), mesh, group.device, TrainSection(precision="fp32"), SEED, muon_comm=comm)
        opt = MuonAdamW(model, ADAMW_LR, AdamWSection(), MuonSection(lr=MUON.lr, comm=comm, ns_dtype=MUON.ns_dtype))
        opt.set_lr_scale(1.0)
        records: list[dict] = []
        if mode == "split":  # the test replays each step from what it started with
            record_each_step(opt, model, records)
        norms, losses = [], []
        for step in range(STEPS):
            x, y = batch(step)
            if mode == "split":
                per_rank = GLOBAL_BATCH // group.world
                x, y = (t[group.rank * per_rank : (group.rank + 1) * per_rank] for t in (x, y))
            loss = cross_entropy(model(x), y)
            losses.append(float(distributed.all_mean(loss)))
            loss.backward()
            norms.append(float(opt.step(max_grad_norm=CLIP if mode == "split" else 0.0)))
            opt.zero_grad()
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        traffic = opt.meter.gather(device=group.device)
        if group.is_main:
            tensors = {k: v.contiguous() for k, v in full.items()}
            if records:
                tensors = {f"final/{k}": v for k, v in tensors.items()} | per_step_tensors(records)
            save_file(tensors, f"{prefix}-{mode}-{comm}.safetensors")
            out[f"{mode}-{comm}"] = {"traffic": traffic, "norms": norms, "losses": losses}
    if group.is_main:
        out["spy"] = spy.report()
        Path(f"{prefix}-report.json").write_text(json.dumps(out))
    distributed.leave(group)


def _run_steps(group, train_section, global_batch: int, micro_batches: int, steps: int = STEPS):
    """`steps` optimizer steps of the trainer's model and optimizer, each rank on its slice of
    the global batch in `micro_batches` micro-batches; the losses (mean over ranks), every
    step's parameters and reduced gradients gathered whole, and the Muon exchanges made."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (group.world,))
    model = build_model(model_config(), mesh, group.device, train_section, SEED)
    opt = MuonAdamW(model, ADAMW_LR, AdamWSection(), MUON)
    opt.set_lr_scale(1.0)
    records: list[dict] = []
    record_each_step(opt, model, records)
    losses = []
    for step in range(steps):
        x, y = batch(step, global_batch)
        per_rank = global_batch // group.world
        x, y = (t[group.rank * per_rank : (group.rank + 1) * per_rank] for t in (x, y))
        loss = accumulate_gradients(model, x, y, micro_batches)
        losses.append(float(distributed.all_mean(loss)))
        opt.step(max_grad_norm=CLIP)
        opt.zero_grad()
    exchanges = opt.meter.totals["muon_to_owner"]["calls"]
    return losses, records, exchanges


def recompute_mode(prefix: str, precision: str = "fp32", compiled: str = "0") -> None:
    torch.set_num_threads(1)
    group = distributed.join(torch.device("cpu"))
    out = {}
    for mode in ("none", "full", "selective"):
        t = TrainSection(precision=precision, compile=compiled == "1", activation_checkpoint=mode)
        losses, records, _ = _run_steps(group, t, GLOBAL_BATCH, 1)
        if group.is_main:
            save_file(per_step_tensors(records), f"{prefix}-{mode}.safetensors")
            out[mode] = losses
    if group.is_main:
        Path(f"{prefix}-report.json").write_text(json.dumps(out))
    distributed.leave(group)


def accumulate_mode(prefix: str) -> None:
    torch.set_num_threads(1)
    group = distributed.join(torch.device("cpu"))
    out = {}
    global_batch = 4 * group.world  # 4 sequences per rank: one batch, or 4 micro-batches of 1
    for micro in (1, 4):
        losses, records, exchanges = _run_steps(group, TrainSection(precision="fp32"), global_batch, micro)
        if group.is_main:
            save_file(per_step_tensors(records), f"{prefix}-{micro}.safetensors")
            out[micro] = {"losses": losses, "exchanges": exchanges}
    if group.is_main:
        Path(f"{prefix}-report.json").write_text(json.dumps(out))
    distributed.leave(group)


def train_mode(prefix: str, config: str, data_dir: str, run_dir: str, stop_at_step: str | None = None) -> None:
    torch.set_num_threads(1)
    spy = CollectiveSpy(torch.device("cpu"))
    cfg = config_from_dict(json.loads(Path(config).read_text()))
    dumped = []

    def dump_optimizer_state(step, model, optimizer):
        if dumped or step == 0:  # a fresh run holds no state yet
            return
        dumped.append(step)
        # every rank its own: with muon.comm owner_reduce a Muon momentum lives on its owner only
        state = get_optimizer_state_dict(
            model,
            optimizer.optimizers,
            options=StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True),
        )
        tensors = {k: v.detach().cpu().contiguous() for k, v in state.items() if isinstance(v, torch.Tensor)}
        save_file(tensors, f"{prefix}-optimizer-rank{dist.get_rank()}.safetensors", metadata={"step": str(step)})

    stop = int(stop_at_step) if stop_at_step else None
    result = train(
        cfg, Path(data_dir), Path(run_dir), before_step=dump_optimizer_state, stop_at_step=stop, progress=False
    )
    if int(os.environ["RANK"]) == 0:  # the process group may be gone: train() left it if it made it
        report = {"spy": spy.report(), "metrics": result.metrics, "history": result.history}
        Path(f"{prefix}-report.json").write_text(json.dumps(report))


if __name__ == "__main__":
    faulthandler.enable()  # a crash inside torch prints every thread's Python stack (test_distributed retries once)
    modes = {"step": step_mode, "train": train_mode, "recompute": recompute_mode, "accumulate": accumulate_mode}
    runs, current = [], []
    for arg in sys.argv[1:]:
        if arg == "+":
            runs.append(current)
            current = []
        else:
            current.append(arg)
    runs.append(current)
    # several modes share one process group: each mode's join finds it, and only this leave ends it
    group = distributed.join(torch.device("cpu")) if len(runs) > 1 else None
    for mode, *rest in runs:
        modes[mode](*rest)
    if group is not None:
        distributed.leave(group)
