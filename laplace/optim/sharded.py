"""Muon + AdamW with sharded optimizer state over torch.distributed (ZeRO-2 style).

Every rank keeps the full parameters (for its forward and backward); all parameters
live, in a fixed order, in one flat fp32 space cut into world_size contiguous shards
(torch.chunk's rule, so DCP can reshard them). Each step:

1. gradients are reduce-scattered: rank r receives every rank's gradient for its shard
   (one all_to_all_single) and averages them in fp64 (exact when ranks agree);
2. AdamW updates the rank's shard element-wise;
3. Muon updates the momentum of the rank's slices of each matrix element-wise, then
   - `alltoall` (the article's): each matrix has an owner rank, chosen greedily by
     Newton-Schulz cost so that owners' work is balanced; one all_to_all_single sends
     every slice (in bf16, which Newton-Schulz starts by casting to anyway) to its
     owner, the owner orthogonalises the whole matrix, a second all_to_all_single
     returns the orthogonalised slices;
   - `allgather` (the baseline): every rank gathers every matrix and orthogonalises
     all of them redundantly;
4. the updated shards are all-gathered back into every rank's full parameters.

The same functions as the single-process `Muon` run on the same values, so the
result equals torch.optim.Muon bit for bit when the gradients are the same.
`TrafficMeter` counts the bytes each rank sends and receives, per collective.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from laplace.config import AdamWSection, MuonSection
from laplace.errors import ConfigError
from laplace.optim.muon import (
    adjusted_lr,
    apply_update_,
    momentum_direction,
    newtonschulz_flops,
    route_parameters,
    zeropower_via_newtonschulz,
)

COMMS = ("alltoall", "allgather")
COLLECTIVES = (
    "grad_reduce_scatter",
    "grad_norm_allreduce",
    "muon_to_owner",
    "muon_from_owner",
    "muon_allgather",
    "param_allgather",
)


def flat_order(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(route, parameter) in the order of the flat space: Muon matrices, then AdamW with and
    without weight decay. The optimizer and the analytic traffic both lay parameters out so."""
    routes = route_parameters(model)
    return [(route, p) for route in ("muon", "adamw_decay", "adamw_no_decay") for _, p in routes[route]]


class TrafficMeter:
    """Bytes sent to and received from other ranks, per collective (self-copies excluded)."""

    def __init__(self):
        self.totals: dict[str, dict[str, int]] = defaultdict(lambda: {"sent": 0, "received": 0, "calls": 0})

    def record(self, name: str, sent: int, received: int) -> None:
        t = self.totals[name]
        t["sent"] += sent
        t["received"] += received
        t["calls"] += 1

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {k: dict(v) for k, v in self.totals.items()}

    def reset(self) -> None:
        self.totals.clear()

    def gather(self, group=None) -> dict[str, dict[str, list[int]]]:
        """Every rank's totals (collective: all ranks call it), as plain tensors, not pickled objects."""
        mine = torch.tensor(
            [[self.totals[c]["sent"], self.totals[c]["received"]] if c in self.totals else [0, 0] for c in COLLECTIVES],
            dtype=torch.long,
        )
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        parts = [torch.zeros_like(mine) for _ in range(world)]
        if world > 1:
            dist.all_gather(parts, mine, group=group)
        else:
            parts = [mine]
        return {
            c: {"sent": [int(p[i, 0]) for p in parts], "received": [int(p[i, 1]) for p in parts]}
            for i, c in enumerate(COLLECTIVES)
        }


def traffic_metrics(gathered: dict[str, dict[str, list[int]]], steps: int) -> dict:
    """Per-rank bytes per optimizer step: by collective, and Muon's total (sent + received)."""
    world = len(next(iter(gathered.values()))["sent"])
    per_rank = {c: [(v["sent"][r] + v["received"][r]) / steps for r in range(world)] for c, v in gathered.items()}
    muon = [sum(per_rank[c][r] for c in per_rank if c.startswith("muon_")) for r in range(world)]
    out = {f"{c}_bytes_per_rank_per_step_max": max(v) for c, v in per_rank.items() if max(v) > 0}
    out["muon_bytes_per_rank_per_step_max"] = max(muon)
    out["muon_bytes_per_rank_per_step_mean"] = sum(muon) / world
    out["by_rank"] = {c: v for c, v in per_rank.items() if max(v) > 0}
    return out


def exchange(
    meter: TrafficMeter, name: str, send: Tensor, send_splits: list[int], recv_splits: list[int], rank: int, group=None
) -> Tensor:
    """all_to_all_single with uneven splits (zeros allowed), metered."""
    out = send.new_empty(sum(recv_splits))
    if dist.get_world_size(group) == 1:
        out.copy_(send)
    else:
        dist.all_to_all_single(
            out, send.contiguous(), output_split_sizes=recv_splits, input_split_sizes=send_splits, group=group
        )
    size = send.element_size()
    meter.record(name, (sum(send_splits) - send_splits[rank]) * size, (sum(recv_splits) - recv_splits[rank]) * size)
    return out


@dataclass(frozen=True)
class Slice:
    """The part of one parameter that falls in one rank's shard."""

    index: int  # parameter index in the layout
    rank: int
    param_lo: int  # flat offsets inside the parameter
    param_hi: int
    shard_lo: int  # offsets inside that rank's shard
    shard_hi: int

    @property
    def size(self) -> int:
        return self.param_hi - self.param_lo


class FlatLayout:
    """Tensors of the given sizes in one flat space, cut into `world` contiguous shards of
    ceil(total/world) elements (torch.chunk's rule)."""

    def __init__(self, sizes: list[int], world: int):
        self.offsets = [0]
        for n in sizes:
            self.offsets.append(self.offsets[-1] + n)
        self.total = self.offsets[-1]
        self.world = world
        self.chunk = math.ceil(self.total / world)
        self.slices: list[list[Slice]] = [[] for _ in range(world)]  # per rank, in tensor order
        self.by_param: list[list[Slice]] = [[] for _ in sizes]  # per tensor, in rank order
        for r in range(world):
            lo, hi = self.shard_range(r)
            for i in range(len(sizes)):
                a, b = max(lo, self.offsets[i]), min(hi, self.offsets[i + 1])
                if a < b:
                    s = Slice(i, r, a - self.offsets[i], b - self.offsets[i], a - lo, b - lo)
                    self.slices[r].append(s)
                    self.by_param[i].append(s)

    def shard_range(self, rank: int) -> tuple[int, int]:
        return min(rank * self.chunk, self.total), min((rank + 1) * self.chunk, self.total)

    def shard_sizes(self) -> list[int]:
        return [hi - lo for lo, hi in (self.shard_range(r) for r in range(self.world))]


def assign_owners(shapes: list[tuple[int, int]], world: int, ns_steps: int) -> list[int]:
    """Owner rank of each matrix: largest Newton-Schulz cost first, to the least-loaded rank
    (ties to the lowest rank). Deterministic: every rank computes the same answer."""
    load = [0] * world
    owners = [0] * len(shapes)
    order = sorted(range(len(shapes)), key=lambda i: (-newtonschulz_flops(*shapes[i], ns_steps), i))
    for i in order:
        r = min(range(world), key=lambda k: (load[k], k))
        owners[i] = r
        load[r] += newtonschulz_flops(*shapes[i], ns_steps)
    return owners


class ShardedMuonAdamW:
    def __init__(
        self,
        model: nn.Module,
        adamw_lr: float,
        adamw: AdamWSection,
        muon: MuonSection,
        comm: str = "alltoall",
        group=None,
    ):
        if comm not in COMMS:
            raise ConfigError(f"muon.comm: unknown strategy {comm!r} (choose from {', '.join(COMMS)})")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.comm = comm
        self.muon_cfg, self.adamw_cfg = muon, adamw
        self.base_lrs = {"muon": muon.lr, "adamw": adamw_lr}
        self.lr_scale = 1.0
        self.meter = TrafficMeter()

        ordered = flat_order(model)
        self.kind: list[str] = [route for route, _ in ordered]
        self.params: list[nn.Parameter] = [p for _, p in ordered]
        self.layout = FlatLayout([p.numel() for p in self.params], self.world)
        lo, hi = self.layout.shard_range(self.rank)
        self.shard = self._flat_params()[lo:hi].clone()  # this rank's fp32 master values
        self.muon_index = [i for i, k in enumerate(self.kind) if k == "muon"]
        self.owner = dict(
            zip(
                self.muon_index,
                assign_owners([tuple(self.params[i].shape) for i in self.muon_index], self.world, muon.ns_steps),
            )
        )

        # Optimizer state as flat shard tensors (what DCP saves); per-slice views feed the math.
        n = hi - lo
        self.momentum = torch.zeros(n)
        self.exp_avg = torch.zeros(n)
        self.exp_avg_sq = torch.zeros(n)
        self._grad_shard = torch.zeros(n)
        groups: dict[str, list[Tensor]] = {"adamw_decay": [], "adamw_no_decay": []}
        self._adamw_slices: list[tuple[Slice, nn.Parameter]] = []
        for s in self.layout.slices[self.rank]:
            if self.kind[s.index] == "muon":
                continue
            view = nn.Parameter(self.shard[s.shard_lo : s.shard_hi])  # shares storage with self.shard
            groups[self.kind[s.index]].append(view)
            self._adamw_slices.append((s, view))
        param_groups = [
            {"params": ps, "weight_decay": wd}
            for ps, wd in ((groups["adamw_decay"], adamw.weight_decay), (groups["adamw_no_decay"], 0.0))
            if ps
        ]
        # a rank whose shard holds only Muon matrices has no AdamW work
        self.adamw = (
            torch.optim.AdamW(param_groups, lr=adamw_lr, betas=tuple(adamw.betas), eps=adamw.eps, foreach=False)
            if param_groups
            else None
        )
        for s, view in self._adamw_slices:  # AdamW increments each param's own step counter
            self.adamw.state[view] = {
                "step": torch.zeros(()),
                "exp_avg": self.exp_avg[s.shard_lo : s.shard_hi],
                "exp_avg_sq": self.exp_avg_sq[s.shard_lo : s.shard_hi],
            }

    # ------------------------------------------------------------------ schedule

    def set_lr_scale(self, scale: float) -> None:
        self.lr_scale = scale
        for g in self.adamw.param_groups if self.adamw else []:
            g["lr"] = self.base_lrs["adamw"] * scale

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def _flat_grads(self) -> Tensor:
        return torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in self.params]
        )

    def _flat_params(self) -> Tensor:
        return torch.cat([p.detach().reshape(-1).float() for p in self.params])

    # ------------------------------------------------------------------ the step

    def reduce_gradients(self) -> Tensor:
        """Reduce-scatter: this rank's shard of the mean gradient (averaged in fp64)."""
        sizes = self.layout.shard_sizes()
        mine = sizes[self.rank]
        received = exchange(
            self.meter, "grad_reduce_scatter", self._flat_grads(), sizes, [mine] * self.world, self.rank, self.group
        )
        if self.world == 1:
            self._grad_shard.copy_(received)
        else:  # fp64: the mean of equal gradients is exactly that gradient, for any world size
            self._grad_shard.copy_(received.view(self.world, mine).double().sum(0) / self.world)
        return self._grad_shard

    def clip_(self, max_norm: float) -> float:
        """Scale the gradient shard so the global norm is at most max_norm; returns the norm."""
        sq = self._grad_shard.double().pow(2).sum()
        if self.world > 1:
            dist.all_reduce(sq, group=self.group)
            self.meter.record("grad_norm_allreduce", 8 * (self.world - 1), 8 * (self.world - 1))
        norm = sq.sqrt().item()
        if max_norm and norm > max_norm:
            self._grad_shard.mul_(max_norm / (norm + 1e-6))
        return norm

    def step(self, max_grad_norm: float = 0.0) -> float:
        """One optimizer step from the .grad of every parameter; returns the global gradient norm."""
        self.reduce_gradients()
        norm = self.clip_(max_grad_norm)
        for s, view in self._adamw_slices:
            view.grad = self._grad_shard[s.shard_lo : s.shard_hi]
        if self.adamw is not None:
            self.adamw.step()
        self._muon_step()
        self._gather_parameters()
        return norm

    def _muon_step(self) -> None:
        m = self.muon_cfg
        lr = self.base_lrs["muon"] * self.lr_scale
        directions: dict[int, Tensor] = {}  # my slices' directions, bf16
        for s in self.layout.slices[self.rank]:
            if self.kind[s.index] != "muon":
                continue
            d = momentum_direction(
                self._grad_shard[s.shard_lo : s.shard_hi],
                self.momentum[s.shard_lo : s.shard_hi],
                m.momentum,
                m.nesterov,
            )
            directions[s.index] = d.bfloat16()  # lossless: Newton-Schulz starts with .bfloat16()
        ortho = self._orthogonalise(directions)
        for s in self.layout.slices[self.rank]:
            if self.kind[s.index] != "muon":
                continue
            shape = tuple(self.params[s.index].shape)
            apply_update_(
                self.shard[s.shard_lo : s.shard_hi],
                ortho[s.index],
                lr,
                m.weight_decay,
                adjusted_lr(lr, m.adjust_lr_fn, shape),
            )

    def _newton_schulz(self, index: int, flat: Tensor) -> Tensor:
        m = self.muon_cfg
        shape = self.params[index].shape
        return zeropower_via_newtonschulz(flat.view(shape), tuple(m.ns_coefficients), m.ns_steps, m.eps).reshape(-1)

    def _orthogonalise(self, directions: dict[int, Tensor]) -> dict[int, Tensor]:
        if self.comm == "alltoall":
            return self._via_owners(directions)
        return self._via_allgather(directions)

    def _via_owners(self, directions: dict[int, Tensor]) -> dict[int, Tensor]:
        L, me, W = self.layout, self.rank, self.world
        # 1st all-to-all: my slice of every matrix goes to its owner (ordered by owner, then matrix)
        send = [directions[i] for r in range(W) for i in self.muon_index if self.owner[i] == r and i in directions]
        send_splits = [
            sum(directions[i].numel() for i in self.muon_index if self.owner[i] == r and i in directions)
            for r in range(W)
        ]
        mine = [i for i in self.muon_index if self.owner[i] == me]
        recv_splits = [sum(s.size for i in mine for s in L.by_param[i] if s.rank == r) for r in range(W)]
        flat_send = torch.cat(send) if send else torch.empty(0, dtype=torch.bfloat16)
        received = exchange(self.meter, "muon_to_owner", flat_send, send_splits, recv_splits, me, self.group)
        # assemble and orthogonalise the matrices I own
        full = {i: torch.empty(self.params[i].numel(), dtype=torch.bfloat16) for i in mine}
        pos = 0
        for r in range(W):
            for i in mine:
                for s in L.by_param[i]:
                    if s.rank == r:
                        full[i][s.param_lo : s.param_hi] = received[pos : pos + s.size]
                        pos += s.size
        done = {i: self._newton_schulz(i, full[i]) for i in mine}
        # 2nd all-to-all: each rank gets back the orthogonalised slices of its shard
        back = [done[i][s.param_lo : s.param_hi] for r in range(W) for i in mine for s in L.by_param[i] if s.rank == r]
        flat_back = torch.cat(back) if back else torch.empty(0, dtype=torch.bfloat16)
        # the way back mirrors the way there: what I received I return, what I sent comes back
        returned = exchange(self.meter, "muon_from_owner", flat_back, recv_splits, send_splits, me, self.group)
        out, pos = {}, 0
        for r in range(W):
            for i in self.muon_index:
                if self.owner[i] == r and i in directions:
                    n = directions[i].numel()
                    out[i] = returned[pos : pos + n]
                    pos += n
        return out

    def _via_allgather(self, directions: dict[int, Tensor]) -> dict[int, Tensor]:
        L, me, W = self.layout, self.rank, self.world
        mine = (
            torch.cat([directions[i] for i in self.muon_index if i in directions])
            if directions
            else torch.empty(0, dtype=torch.bfloat16)
        )
        sizes = [sum(s.size for s in L.slices[r] if self.kind[s.index] == "muon") for r in range(W)]
        gathered = exchange(self.meter, "muon_allgather", mine.repeat(W), [mine.numel()] * W, sizes, me, self.group)
        full = {i: torch.empty(self.params[i].numel(), dtype=torch.bfloat16) for i in self.muon_index}
        pos = 0
        for r in range(W):
            for s in L.slices[r]:
                if self.kind[s.index] == "muon":
                    full[s.index][s.param_lo : s.param_hi] = gathered[pos : pos + s.size]
                    pos += s.size
        out = {}
        for i in self.muon_index:  # every rank orthogonalises every matrix
            ortho = self._newton_schulz(i, full[i])
            mine_slice = next((s for s in L.by_param[i] if s.rank == me), None)
            if mine_slice is not None:
                out[i] = ortho[mine_slice.param_lo : mine_slice.param_hi]
        return out

    def _gather_parameters(self) -> None:
        sizes = self.layout.shard_sizes()
        flat = exchange(
            self.meter,
            "param_allgather",
            self.shard.repeat(self.world),
            [self.shard.numel()] * self.world,
            sizes,
            self.rank,
            self.group,
        )
        with torch.no_grad():
            for i, p in enumerate(self.params):
                p.copy_(flat[self.layout.offsets[i] : self.layout.offsets[i + 1]].view_as(p))

    # ------------------------------------------------------------------ state

    def state_tensors(self) -> dict[str, Tensor]:
        """This rank's flat shards of the optimizer state."""
        return {"momentum": self.momentum, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def set_adamw_steps(self, steps: int) -> None:
        """AdamW's step count (one per training step, the same for every parameter) after a resume."""
        for st in self.adamw.state.values() if self.adamw else []:
            st["step"].fill_(steps)

    def load_master(self) -> None:
        """Re-read this rank's shard from the (freshly loaded) parameters."""
        lo, hi = self.layout.shard_range(self.rank)
        self.shard.copy_(self._flat_params()[lo:hi])


# --------------------------------------------------------------------------- analytic traffic


def muon_traffic(
    kinds: list[str], shapes: list[tuple[int, ...]], world: int, bytes_per_value: int = 2, ns_steps: int = 5
) -> dict:
    """Per-rank Muon bytes (sent + received) of one optimizer step, computed from the layout the
    optimizer would use: `kinds` are the routes ("muon" or AdamW) in flat order."""
    layout = FlatLayout([math.prod(s) for s in shapes], world)
    muon = [i for i, k in enumerate(kinds) if k == "muon"]
    owner = dict(zip(muon, assign_owners([tuple(shapes[i]) for i in muon], world, ns_steps)))
    held = [sum(s.size for s in layout.slices[r] if s.index in owner) for r in range(world)]
    total = sum(math.prod(shapes[i]) for i in muon)
    allgather, alltoall = [], []
    for r in range(world):
        allgather.append(held[r] * (world - 1) + (total - held[r]))  # send my slices to all, receive the rest
        out = sum(s.size for s in layout.slices[r] if s.index in owner and owner[s.index] != r)
        inc = sum(s.size for i in muon if owner[i] == r for s in layout.by_param[i] if s.rank != r)
        alltoall.append(2 * (out + inc))  # to the owners and back
    to_bytes = lambda xs: [x * bytes_per_value for x in xs]  # noqa: E731
    ag, a2a = to_bytes(allgather), to_bytes(alltoall)
    return {
        "world_size": world,
        "muon_matrices": len(muon),
        "muon_values": total,
        "bytes_per_value": bytes_per_value,
        "allgather_bytes_per_rank_max": max(ag),
        "allgather_bytes_per_rank_mean": sum(ag) / world,
        "alltoall_bytes_per_rank_max": max(a2a),
        "alltoall_bytes_per_rank_mean": sum(a2a) / world,
        "ratio_mean": (sum(ag) / max(1, sum(a2a))),
        "ideal_ratio": world / 2,
    }


def model_traffic(model: nn.Module, world: int, bytes_per_value: int = 2, ns_steps: int = 5) -> dict:
    """muon_traffic for a model (works on the meta device: only shapes are read)."""
    ordered = flat_order(model)
    return muon_traffic(
        [route for route, _ in ordered], [tuple(p.shape) for _, p in ordered], world, bytes_per_value, ns_steps
    )
