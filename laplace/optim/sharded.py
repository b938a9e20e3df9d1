"""Muon over FSDP2's row shards, and the meter of the bytes it moves.

FSDP2 (`torch.distributed.fsdp.fully_shard`) leaves every parameter, gradient and
optimizer state as a DTensor sharded by rows over a 1-D mesh: rank r holds rows
[r*c, (r+1)*c) of an R-row matrix, c = ceil(R/W) (torch.chunk's rule; the last ranks may
hold fewer rows, or none). AdamW is element-wise and steps those shards directly
(`torch.optim.AdamW`, fused on CUDA, foreach elsewhere). Muon's momentum and update are element-wise too, but
Newton-Schulz needs whole matrices. `ShardedMuon` gets them one of two ways (`muon.comm`):

- `alltoall`, the article's design: each matrix has one owner rank, chosen by bytes so the
  owners' loads are close (laplace.optim.exchange.ExchangePlan). Every rank pads its row
  shard of every matrix to c rows and every rank-to-owner segment to the busiest owner's
  length, so it sends exactly as many values to each rank as it receives from each: one
  `all_to_all_single` with equal splits carries every matrix, in bf16 (Newton-Schulz casts
  to bf16 first anyway). Each owner orthogonalises its whole matrices; a second
  `all_to_all_single` returns every rank its rows.
- `allgather`, the baseline: one `all_gather_single` gives every rank every matrix,
  and every rank orthogonalises all of them.
- `owner_reduce`, no exchange of its own (torchtitan's communication-free Muon, pytorch/
  torchtitan PR 3502): FSDP2 leaves the Muon matrices out (`fully_shard(ignored_params=...)`,
  laplace.training.distributed.shard_model), so they are plain tensors, whole on every rank.
  After backward each gradient is summed straight onto its owner (`dist.reduce`, the same LPT
  owners as `alltoall`) and freed elsewhere: that reduction is the one data parallelism pays
  for anyway, in place of FSDP2's reduce-scatter of those matrices. The owner keeps the
  momentum and runs Newton-Schulz on its whole matrices with no collective in `step`; one
  `dist.broadcast` per matrix then gives every rank the updated weights, in place of FSDP2's
  all-gathers (once per step, where FSDP2 gathers a block for its forward and again for its
  backward). Why not the other layouts torch 2.13 offers: `fully_shard`'s
  `shard_placement_fn` picks a dimension, never a rank, so every rank still gets a piece of
  every matrix; a shard-aligned flat bucket (Megatron's) would mean writing our own FSDP. The
  price is memory: every rank holds every Muon matrix whole, and each owner its momentum
  whole (`laplace plan` shows both). fp32 only: FSDP2's bf16 policy casts the blocks' inputs
  to bf16, which a plain fp32 matrix cannot multiply, so with train.precision bf16 the
  optimizer runs `alltoall` (MuonAdamW picks it from how the matrices were sharded).

Every collective tensor lives on the parameters' device; the exchange is bf16, the
gradient norm fp32, the traffic meter int64 (nothing is fp64, which Trainium lacks),
and every split is equal. The Muon arithmetic is the element-wise and Newton-Schulz
pieces of laplace.optim.muon, in torch.optim.Muon's order: on the same gradients the
result is torch.optim.Muon's bit for bit (tests/test_muon.py).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from laplace.errors import ConfigError
from laplace.optim.exchange import COLLECTIVES, ExchangePlan
from laplace.optim.muon import (
    CompiledMuonUpdate,
    adjusted_lr,
    apply_update_,
    momentum_direction,
    newton_schulz_dtype,
    zeropower_via_newtonschulz,
)
from laplace.sharding import local_rows

COMMS = ("owner_reduce", "alltoall", "allgather")
EXCHANGE_DTYPE = torch.bfloat16  # EXCHANGE_BYTES wide (laplace.optim.exchange)


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
        ns_dtype: str = "bfloat16",
    ):
        """compile_backend: None runs the eager pieces (torch.optim.Muon's result bit for bit);
        a torch.compile backend runs them as CompiledMuonUpdate's graphs, the LR a tensor.
        ns_dtype: Newton-Schulz's arithmetic, `muon.ns_dtype` (laplace.optim.muon.newton_schulz_dtype);
        bfloat16 is torch.optim.Muon's."""
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
        self.ns_dtype = newton_schulz_dtype(ns_dtype, everything[0].device if everything else "cpu")
        self.owners: list[int] = []  # owner_reduce: the rank that owns each matrix (in `everything`'s order)
        if comm == "owner_reduce":
            if any(isinstance(p, DTensor) for p in everything):
                raise ValueError("owner_reduce needs the Muon matrices left out of FSDP2 (whole on every rank)")
            if dist.is_initialized() and dist.get_world_size() > 1:
                self.group, self.world, self.rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
            self.owners = [s.owner for s in ExchangePlan([tuple(p.shape) for p in everything], self.world).slots]
            self._owner_of = {id(p): o for p, o in zip(everything, self.owners)}
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
        # so every rank builds the same plan and joins the same collectives. owner_reduce: each
        # rank steps the matrices it owns, whole, and nothing else (no collective here).
        entries = [(p, g) for g in self.param_groups for p in g["params"] if p.grad is not None and self._mine(p)]
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
        if self.world == 1 or self.comm == "owner_reduce":
            # one rank owns every matrix whole: no [1, segment] exchange buffers (two bf16 copies of
            # every Muon value). Newton-Schulz casts to bf16 first, so the numbers are the same.
            ortho = self._orthogonalise(directions, settings)
        elif self.comm == "alltoall":
            ortho = self._via_owners(shapes, directions, settings)
        else:
            ortho = self._via_allgather(shapes, directions, settings)
        self._apply(entries, ortho)
        return loss

    def owner_of(self, p: Tensor) -> int | None:
        """owner_reduce: the rank that holds the matrix p's reduced gradient and momentum whole.
        None in the other modes, and for a tensor that is not one of this optimizer's."""
        return self._owner_of.get(id(p)) if self.owners else None

    def _mine(self, p: Tensor) -> bool:
        return not self.owners or self.owner_of(p) == self.rank

    def _matrices(self) -> list[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """owner_reduce, after backward (collective): each matrix's gradient summed onto its owner and
        averaged there, as FSDP2's reduce-scatter averages; the other ranks drop theirs. Every
        rank holds a gradient of every matrix (the same graph), so all join the same reduces."""
        if not self.owners or self.group is None:
            return
        works, moved = [], {"sent": 0, "received": 0}
        for p, owner in zip(self._matrices(), self.owners):
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # unused in this step's graph: still every rank's part
            works.append(dist.reduce(p.grad, dst=owner, op=dist.ReduceOp.SUM, group=self.group, async_op=True))
            size = p.grad.numel() * p.grad.element_size()
            moved["received" if owner == self.rank else "sent"] += size * (self.world - 1 if owner == self.rank else 1)
        for w in works:
            w.wait()
        for p, owner in zip(self._matrices(), self.owners):
            if owner == self.rank:
                p.grad.div_(self.world)
            else:
                p.grad = None
        self.meter.record("muon_grad_reduce", moved["sent"], moved["received"])

    @torch.no_grad()
    def broadcast_parameters(self) -> None:
        """owner_reduce, after the step (collective): every matrix from its owner to every rank."""
        if not self.owners or self.group is None:
            return
        works, moved = [], {"sent": 0, "received": 0}
        for p, owner in zip(self._matrices(), self.owners):
            works.append(dist.broadcast(p.data, src=owner, group=self.group, async_op=True))
            size = p.numel() * p.element_size()
            moved["sent" if owner == self.rank else "received"] += size * (self.world - 1 if owner == self.rank else 1)
        for w in works:
            w.wait()
        self.meter.record("muon_param_broadcast", moved["sent"], moved["received"])

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
                members,
                self.compiled.orthogonalise([fulls[k] for k in members], coefficients, steps, eps, self.ns_dtype),
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
        return zeropower_via_newtonschulz(full, tuple(coefficients), steps, eps, self.ns_dtype)

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
        for s in plan.slots:
            d = directions[s.index]
            send[s.owner, s.offset : s.offset + d.numel()] = d.reshape(-1)
        received = self._exchange("muon_to_owner", send)
        # received[r] holds rank r's row shard of each matrix I own: stack them, orthogonalise
        back = torch.zeros_like(send)
        owned = plan.owned_by(me)
        fulls = [
            received[:, s.offset : s.offset + s.chunk].reshape(W * s.rows, s.shape[1])[: s.shape[0]] for s in owned
        ]
        for s, full, ortho in zip(owned, fulls, self._orthogonalise(fulls, [settings[s.index] for s in owned])):
            padded = full.new_zeros(W * s.rows, s.shape[1])
            padded[: s.shape[0]] = ortho
            back[:, s.offset : s.offset + s.chunk] = padded.view(W, s.chunk)  # rank r's rows go to rank r
        # 2nd all-to-all: the way back mirrors the way there; returned[owner] holds my rows
        returned = self._exchange("muon_from_owner", back)
        return [returned[s.owner, s.offset : s.offset + d.numel()].view_as(d) for s, d in zip(plan.slots, directions)]

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
