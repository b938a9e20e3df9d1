"""Muon over FSDP2's row shards, AdamW on the other shards, and the traffic Muon costs.

FSDP2 (`torch.distributed.fsdp.fully_shard`) leaves every parameter, gradient and
optimizer state as a DTensor sharded by rows over a 1-D mesh: rank r holds rows
[r*c, (r+1)*c) of an R-row matrix, c = ceil(R/W) (torch.chunk's rule; the last ranks may
hold fewer rows, or none). AdamW is element-wise and steps those shards directly
(`torch.optim.AdamW`, fused on CUDA, foreach elsewhere). Muon's momentum and update are element-wise too, but
Newton-Schulz needs whole matrices. `ShardedMuon` gets them one of two ways (`muon.comm`):

- `alltoall`, the article's design with Dion's batching: the matrices of one shape are
  cut into batches of W, and each matrix of a batch has its own owner rank. Every rank
  pads its row shard of every matrix to c rows, so it sends exactly as many values to
  each rank as it receives from each: one `all_to_all_single` with equal splits carries
  every batch, in bf16 (Newton-Schulz casts to bf16 first anyway). Each owner
  orthogonalises its whole matrices; a second `all_to_all_single` returns every rank its
  rows. Only a shape's last batch is padded, with empty slots nobody orthogonalises;
  the owners of those last batches rotate across shapes, so no rank collects them all.
- `allgather`, the baseline: one `all_gather_single` gives every rank every matrix,
  and every rank orthogonalises all of them.

Every collective tensor lives on the parameters' device; the exchange is bf16, the
gradient norm fp32, the traffic meter int64 (nothing is fp64, which Trainium lacks),
and every split is equal. The Muon arithmetic is the element-wise and Newton-Schulz
pieces of laplace.optim.muon, in torch.optim.Muon's order: on the same gradients the
result is torch.optim.Muon's bit for bit (tests/test_muon.py).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from laplace.config import AdamWSection, MuonSection
from laplace.errors import ConfigError
from laplace.model.lm import local_rows
from laplace.optim.muon import (
    CompiledMuonUpdate,
    adjusted_lr,
    apply_update_,
    momentum_direction,
    route_parameters,
    zeropower_via_newtonschulz,
)

COMMS = ("alltoall", "allgather")
COLLECTIVES = ("muon_to_owner", "muon_from_owner", "muon_allgather")
EXCHANGE_DTYPE = torch.bfloat16


# --------------------------------------------------------------------------- local shards


def _mesh_group(params: list[Tensor]):
    """(process group, world size, rank) of the parameters' mesh; (None, 1, 0) for plain tensors."""
    from torch.distributed.tensor import DTensor

    meshes = {id(p.device_mesh): p.device_mesh for p in params if isinstance(p, DTensor)}
    if not meshes:
        return None, 1, 0
    if len(meshes) > 1 or not all(isinstance(p, DTensor) for p in params):
        raise ValueError("ShardedMuon needs all its parameters on one device mesh (or none sharded)")
    mesh = next(iter(meshes.values()))
    return mesh.get_group(), mesh.size(), mesh.get_local_rank()


# --------------------------------------------------------------------------- the exchange plan


@dataclass(frozen=True)
class Batch:
    """Up to W matrices of one shape; `owners[k]` is the rank that orthogonalises `members[k]`."""

    shape: tuple[int, int]
    members: tuple[int, ...]  # indices into the optimizer's matrix list
    owners: tuple[int, ...]
    rows: int  # every rank's row shard, padded: ceil(R / W)
    offset: int  # where the batch starts in each rank-to-rank segment

    @property
    def chunk(self) -> int:
        """Values each rank sends each owner for this batch (its padded row shard)."""
        return self.rows * self.shape[1]


@dataclass
class ExchangePlan:
    """How `alltoall` packs every matrix into one equal-split all-to-all, and `allgather` into
    one all-gather. Depends only on the shapes and W, so every rank builds the same plan."""

    shapes: list[tuple[int, int]]
    world: int
    batches: list[Batch] = field(default_factory=list)
    segment: int = 0  # values each rank sends to (and receives from) each rank, per all-to-all
    allgather_offsets: list[int] = field(default_factory=list)
    allgather_segment: int = 0  # values each rank contributes to the all-gather

    def __post_init__(self):
        W = self.world
        by_shape: dict[tuple[int, int], list[int]] = defaultdict(list)
        for i, shape in enumerate(self.shapes):
            by_shape[tuple(shape)].append(i)
        first_owner = 0  # rotates across partial batches, so leftover matrices spread over the ranks
        for shape, members in by_shape.items():
            rows = -(-shape[0] // W)
            for start in range(0, len(members), W):
                batch = tuple(members[start : start + W])
                owners = tuple((first_owner + k) % W for k in range(len(batch)))
                if len(batch) < W:
                    first_owner = (first_owner + len(batch)) % W
                self.batches.append(Batch(shape, batch, owners, rows, self.segment))
                self.segment += rows * shape[1]
        for shape in self.shapes:
            self.allgather_offsets.append(self.allgather_segment)
            self.allgather_segment += -(-shape[0] // W) * shape[1]

    @property
    def padding_slots(self) -> int:
        return sum(self.world - len(b.members) for b in self.batches)

    def owned_by(self, rank: int) -> list[tuple[Batch, int]]:
        """(batch, matrix index) of every matrix `rank` orthogonalises."""
        return [(b, m) for b in self.batches for m, o in zip(b.members, b.owners) if o == rank]


# --------------------------------------------------------------------------- traffic


class TrafficMeter:
    """Bytes sent to and received from other ranks, per collective (what stays on a rank excluded)."""

    def __init__(self):
        self.totals: dict[str, dict[str, int]] = defaultdict(lambda: {"sent": 0, "received": 0, "calls": 0})

    def record(self, name: str, sent: int, received: int) -> None:
        t = self.totals[name]
        t["sent"] += sent
        t["received"] += received
        t["calls"] += 1

    def reset(self) -> None:
        self.totals.clear()

    def gather(self, group=None, device: torch.device | str = "cpu") -> dict[str, dict[str, list[int]]]:
        """Every rank's totals (collective: all ranks call it). One int64 tensor on `device`."""
        mine = torch.tensor(
            [[self.totals[c]["sent"], self.totals[c]["received"]] if c in self.totals else [0, 0] for c in COLLECTIVES],
            dtype=torch.long,
            device=device,
        )
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        everyone = mine.new_empty(world * mine.shape[0], mine.shape[1])  # the ranks' rows, one after another
        if dist.is_initialized():
            dist.all_gather_single(everyone, mine, group=group)
        else:
            everyone.copy_(mine)
        rows = everyone.view(world, *mine.shape).cpu().tolist()
        return {
            c: {"sent": [rows[r][i][0] for r in range(world)], "received": [rows[r][i][1] for r in range(world)]}
            for i, c in enumerate(COLLECTIVES)
        }


def traffic_metrics(gathered: dict[str, dict[str, list[int]]], steps: int) -> dict:
    """Per-rank Muon bytes per optimizer step: by collective, and in total (sent + received)."""
    world = len(next(iter(gathered.values()))["sent"])
    per_rank = {c: [(v["sent"][r] + v["received"][r]) / steps for r in range(world)] for c, v in gathered.items()}
    muon = [sum(per_rank[c][r] for c in per_rank) for r in range(world)]
    out = {f"{c}_bytes_per_rank_per_step_max": max(v) for c, v in per_rank.items() if max(v) > 0}
    out["muon_bytes_per_rank_per_step_max"] = max(muon)
    out["muon_bytes_per_rank_per_step_mean"] = sum(muon) / world
    return out


def muon_traffic(shapes: list[tuple[int, int]], world: int, bytes_per_value: int = 2) -> dict:
    """Muon bytes per rank (sent + received) of one optimizer step for matrices of these shapes,
    from the plan the optimizer runs. Splits are equal, so every rank moves the same bytes."""
    plan = ExchangePlan([tuple(s) for s in shapes], world)
    values = sum(r * c for r, c in plan.shapes)
    others = world - 1
    alltoall = 2 * 2 * others * plan.segment * bytes_per_value  # two all-to-alls, each sent + received
    allgather = 2 * others * plan.allgather_segment * bytes_per_value
    # what the same exchange would move with no padding at all (the ideal the article's figures assume)
    unpadded_alltoall = 2 * 2 * values * others / world / world * bytes_per_value if world > 1 else 0
    return {
        "world_size": world,
        "muon_matrices": len(plan.shapes),
        "muon_values": values,
        "bytes_per_value": bytes_per_value,
        "batches": len(plan.batches),
        "padding_slots": plan.padding_slots,
        "alltoall_bytes_per_rank": alltoall,
        "allgather_bytes_per_rank": allgather,
        "alltoall_unpadded_bytes_per_rank": unpadded_alltoall,
        "ratio": allgather / alltoall if alltoall else None,
        "ideal_ratio": world / 2,
    }


def model_traffic(model: nn.Module, world: int, bytes_per_value: int = 2) -> dict:
    """`muon_traffic` of a model's Muon matrices (works on the meta device: only shapes are read)."""
    return muon_traffic([tuple(p.shape) for _, p in route_parameters(model)["muon"]], world, bytes_per_value)


# --------------------------------------------------------------------------- Muon


class ShardedMuon(torch.optim.Optimizer):
    """torch.optim.Muon's algorithm and arguments over row-sharded DTensor parameters (FSDP2's),
    with Newton-Schulz on whole matrices by owner ranks (`comm="alltoall"`) or everywhere
    (`comm="allgather"`). On plain tensors it is single-process Muon."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315),
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        comm: str = "alltoall",
        meter: TrafficMeter | None = None,
        compile_backend: str | None = None,
    ):
        """compile_backend: None runs the eager pieces (torch.optim.Muon's result bit for bit);
        a torch.compile backend runs them as CompiledMuonUpdate's graphs, the LR a tensor."""
        if comm not in COMMS:
            raise ConfigError(f"muon.comm: unknown strategy {comm!r} (choose from {', '.join(COMMS)})")
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=tuple(ns_coefficients),
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
        )
        super().__init__(params, defaults)
        self.comm = comm
        self.meter = meter or TrafficMeter()
        everything = [p for g in self.param_groups for p in g["params"]]
        for p in everything:
            if p.ndim != 2:
                raise ValueError(f"Muon only takes 2-D parameters, got shape {tuple(p.shape)}")
        self.group, self.world, self.rank = _mesh_group(everything)
        self._plans: dict[tuple, ExchangePlan] = {}
        self.compiled = CompiledMuonUpdate(compile_backend) if compile_backend else None

    def plan(self, shapes: list[tuple[int, int]]) -> ExchangePlan:
        key = tuple(shapes)
        if key not in self._plans:
            self._plans[key] = ExchangePlan(list(shapes), self.world)
        return self._plans[key]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Every rank has a gradient for the same parameters (FSDP2 reduce-scatters them all),
        # so every rank builds the same plan and joins the same collectives.
        entries = [(p, g) for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not entries:
            return loss
        bufs = []
        for p, _ in entries:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            bufs.append(local_rows(state["momentum_buffer"])[0])
        grads = [local_rows(p.grad)[0] for p, _ in entries]
        directions = self._directions(entries, grads, bufs)
        settings = [(g["ns_coefficients"], g["ns_steps"], g["eps"]) for _, g in entries]
        shapes = [tuple(p.shape) for p, _ in entries]
        if self.comm == "alltoall":
            ortho = self._via_owners(shapes, directions, settings)
        else:
            ortho = self._via_allgather(shapes, directions, settings)
        self._apply(entries, ortho)
        return loss

    def _by_group(self, entries) -> dict[int, list[int]]:
        """Entry indices per param group (a compiled phase runs once per group: its constants)."""
        index = {id(g): i for i, g in enumerate(self.param_groups)}
        out: dict[int, list[int]] = defaultdict(list)
        for k, (_, g) in enumerate(entries):
            out[index[id(g)]].append(k)
        return out

    def _directions(self, entries, grads: list[Tensor], bufs: list[Tensor]) -> list[Tensor]:
        if self.compiled is None:
            return [
                momentum_direction(grad, buf, g["momentum"], g["nesterov"])
                for grad, buf, (_, g) in zip(grads, bufs, entries)
            ]
        out: list[Tensor] = [None] * len(entries)  # type: ignore[list-item]
        for gi, members in self._by_group(entries).items():
            g = self.param_groups[gi]
            found = self.compiled.directions(
                [grads[k] for k in members], [bufs[k] for k in members], g["momentum"], g["nesterov"]
            )
            for k, d in zip(members, found):
                out[k] = d
        return out

    def _orthogonalise(self, fulls: list[Tensor], settings: list) -> list[Tensor]:
        """Newton-Schulz of whole matrices: one at a time eagerly, or one graph per distinct setting."""
        if self.compiled is None:
            return [self._newton_schulz(f, s) for f, s in zip(fulls, settings)]
        out: list[Tensor] = [None] * len(fulls)  # type: ignore[list-item]
        by_setting: dict[tuple, list[int]] = defaultdict(list)
        for k, (coefficients, steps, eps) in enumerate(settings):
            by_setting[(tuple(coefficients), steps, eps)].append(k)
        for (coefficients, steps, eps), members in by_setting.items():
            for k, o in zip(
                members, self.compiled.orthogonalise([fulls[k] for k in members], coefficients, steps, eps)
            ):
                out[k] = o
        return out

    def _apply(self, entries, ortho: list[Tensor]) -> None:
        if self.compiled is None:
            for (p, g), update in zip(entries, ortho):
                lr = g["lr"]
                param, _ = local_rows(p)
                apply_update_(param, update, lr, g["weight_decay"], adjusted_lr(lr, g["adjust_lr_fn"], tuple(p.shape)))
            return
        for gi, members in self._by_group(entries).items():
            g = self.param_groups[gi]
            params = [local_rows(entries[k][0])[0] for k in members]
            lr = self.compiled.lr_tensor(gi, g["lr"], params[0].device)
            factors = [adjusted_lr(1.0, g["adjust_lr_fn"], tuple(entries[k][0].shape)) for k in members]
            self.compiled.apply(params, [ortho[k] for k in members], lr, g["weight_decay"], factors)

    def _newton_schulz(self, full: Tensor, settings) -> Tensor:
        coefficients, steps, eps = settings
        return zeropower_via_newtonschulz(full, tuple(coefficients), steps, eps)

    def _exchange(self, name: str, send: Tensor) -> Tensor:
        """all_to_all_single of [W, segment] with equal splits, metered."""
        if self.group is None:  # plain tensors, one process
            return send
        out = torch.empty_like(send)
        dist.all_to_all_single(out, send, group=self.group)
        moved = (self.world - 1) * send.shape[1] * send.element_size()
        self.meter.record(name, moved, moved)
        return out

    def _via_owners(self, shapes, directions: list[Tensor], settings) -> list[Tensor]:
        W, me = self.world, self.rank
        plan = self.plan(shapes)
        device = directions[0].device
        # 1st all-to-all: send[owner] holds my padded row shard of each matrix that rank owns
        send = torch.zeros(W, plan.segment, dtype=EXCHANGE_DTYPE, device=device)
        for b in plan.batches:
            for m, owner in zip(b.members, b.owners):
                d = directions[m]
                send[owner, b.offset : b.offset + d.numel()] = d.reshape(-1)
        received = self._exchange("muon_to_owner", send)
        # received[r] holds rank r's row shard of each matrix I own: stack them, orthogonalise
        back = torch.zeros_like(send)
        owned = plan.owned_by(me)
        fulls = [
            received[:, b.offset : b.offset + b.chunk].reshape(W * b.rows, b.shape[1])[: b.shape[0]] for b, _ in owned
        ]
        for (b, _), full, ortho in zip(owned, fulls, self._orthogonalise(fulls, [settings[m] for _, m in owned])):
            padded = full.new_zeros(W * b.rows, b.shape[1])
            padded[: b.shape[0]] = ortho
            back[:, b.offset : b.offset + b.chunk] = padded.view(W, b.chunk)  # rank r's rows go to rank r
        # 2nd all-to-all: the way back mirrors the way there; returned[owner] holds my rows
        returned = self._exchange("muon_from_owner", back)
        out: list[Tensor] = [None] * len(directions)  # type: ignore[list-item]
        for b in plan.batches:
            for m, owner in zip(b.members, b.owners):
                d = directions[m]
                out[m] = returned[owner, b.offset : b.offset + d.numel()].view_as(d)
        return out

    def _via_allgather(self, shapes, directions: list[Tensor], settings) -> list[Tensor]:
        W, me = self.world, self.rank
        plan = self.plan(shapes)
        device = directions[0].device
        send = torch.zeros(plan.allgather_segment, dtype=EXCHANGE_DTYPE, device=device)
        for off, d in zip(plan.allgather_offsets, directions):
            send[off : off + d.numel()] = d.reshape(-1)
        if self.group is not None:
            gathered = send.new_empty(W * plan.allgather_segment)
            dist.all_gather_single(gathered, send, group=self.group)
            gathered = gathered.view(W, plan.allgather_segment)
            moved = (W - 1) * send.numel() * send.element_size()
            self.meter.record("muon_allgather", moved, moved)
        else:
            gathered = send.view(1, -1)
        per_rank = [-(-rows // W) for rows, _ in shapes]
        fulls = [
            gathered[:, off : off + n * cols].reshape(W * n, cols)[:rows]
            for (rows, cols), off, n in zip(shapes, plan.allgather_offsets, per_rank)
        ]
        orthos = self._orthogonalise(fulls, settings)  # every rank orthogonalises every matrix
        # my rows of each, copied so the whole matrices can go
        return [o[me * n : me * n + d.shape[0]].clone() for o, n, d in zip(orthos, per_rank, directions)]


# --------------------------------------------------------------------------- Muon + AdamW


class ShardedMuonAdamW:
    """The training optimizer over an FSDP2 model: ShardedMuon for the blocks' 2-D matrices,
    AdamW (fused on CUDA, foreach elsewhere, on the DTensor shards) for embeddings, head, norms, biases and
    convolutions (route_parameters), one LR schedule, and global-norm clipping.
    `optimizers` are plain torch.optim.Optimizers, so torch.distributed.checkpoint.state_dict
    saves and reshards their state."""

    def __init__(
        self,
        model: nn.Module,
        adamw_lr: float,
        adamw: AdamWSection,
        muon: MuonSection,
        compile_backend: str | None = None,
    ):
        """compile_backend: compile the Muon update (CompiledMuonUpdate); None runs it eagerly."""
        self.routes = route_parameters(model)
        self.base_lrs = {"muon": muon.lr, "adamw": adamw_lr}
        self.muon = ShardedMuon(
            [p for _, p in self.routes["muon"]],
            lr=muon.lr,
            weight_decay=muon.weight_decay,
            momentum=muon.momentum,
            nesterov=muon.nesterov,
            ns_coefficients=tuple(muon.ns_coefficients),
            eps=muon.eps,
            ns_steps=muon.ns_steps,
            adjust_lr_fn=muon.adjust_lr_fn,
            comm=muon.comm,
            compile_backend=compile_backend,
        )
        groups = [
            {"params": [p for _, p in self.routes[route]], "weight_decay": wd}
            for route, wd in (("adamw_decay", adamw.weight_decay), ("adamw_no_decay", 0.0))
            if self.routes[route]
        ]
        # fused (one kernel for every tensor) on CUDA; foreach elsewhere, as the CPU figures were measured
        fused = any(p.device.type == "cuda" for members in self.routes.values() for _, p in members)
        self.adamw = torch.optim.AdamW(
            groups, lr=adamw_lr, betas=tuple(adamw.betas), eps=adamw.eps, foreach=not fused, fused=fused or None
        )
        self.optimizers = [self.muon, self.adamw]
        self.params = [p for members in self.routes.values() for _, p in members]

    @property
    def meter(self) -> TrafficMeter:
        return self.muon.meter

    def set_lr_scale(self, scale: float) -> None:
        for g in self.muon.param_groups:
            g["lr"] = self.base_lrs["muon"] * scale
        for g in self.adamw.param_groups:
            g["lr"] = self.base_lrs["adamw"] * scale

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """The global gradient norm (an fp32 tensor on the parameters' device, the same on every
        rank); gradients are scaled down to `max_norm` when it is > 0 and exceeded."""
        from torch.distributed.tensor import DTensor

        grads = [p.grad for p in self.params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)  # foreach where torch picks it, as clip_grad_norm_
        if isinstance(norm, DTensor):  # a partial sum over the shards: all-reduced here
            norm = norm.full_tensor()
        if max_norm:
            torch.nn.utils.clip_grads_with_norm_(self.params, max_norm, norm)
        return norm

    def step(self, max_grad_norm: float = 0.0) -> Tensor:
        """Clip, then one Muon and one AdamW step; returns the global gradient norm (a tensor)."""
        norm = self.clip_grad_norm_(max_grad_norm)
        self.muon.step()
        self.adamw.step()
        return norm

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
