"""The training optimizer: Muon for the blocks' 2-D matrices, AdamW for everything else.

One wrapper over any model, sharded by FSDP2 or not: `ShardedMuon` (laplace.optim.sharded)
steps row-sharded DTensors with owner ranks, and plain tensors as single-process Muon
(torch.optim.Muon's result bit for bit). `optimizers` are plain torch.optim.Optimizers, so
torch.distributed.checkpoint.state_dict saves and reshards their state.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from laplace.config import AdamWSection, MuonSection
from laplace.optim.muon import muon_hyperparameters, route_parameters
from laplace.optim.sharded import ShardedMuon, TrafficMeter


class MuonAdamW:
    """ShardedMuon for the blocks' 2-D matrices, AdamW (fused on CUDA, foreach elsewhere, on the
    DTensor shards when sharded) for embeddings, head, norms, biases and convolutions
    (route_parameters), one LR schedule, and global-norm clipping."""

    def __init__(
        self,
        model: nn.Module,
        adamw_lr: float,
        adamw: AdamWSection,
        muon: MuonSection,
        compile_backend: str | None = None,
    ):
        """compile_backend: compile the Muon update (CompiledMuonUpdate); None runs it eagerly."""
        from torch.distributed.tensor import DTensor

        self.routes = route_parameters(model)
        self.base_lrs = {"muon": muon.lr, "adamw": adamw_lr}
        matrices = [p for _, p in self.routes["muon"]]
        # owner_reduce where it applies: the matrices were left out of FSDP2 (shard_model does it
        # for fp32 runs); FSDP2 sharded them (bf16) -> the owner-rank all-to-all
        comm = muon.comm
        if comm == "owner_reduce" and any(isinstance(p, DTensor) for p in matrices):
            comm = "alltoall"
        self.muon = ShardedMuon(
            matrices,
            **muon_hyperparameters(muon),
            comm=comm,
            compile_backend=compile_backend,
            ns_dtype=muon.ns_dtype,
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
        owners = bool(self.muon.owners) and self.muon.group is not None  # owner_reduce on several ranks
        if owners:
            # owner_reduce: each Muon gradient whole on its owner alone, the rest DTensor row shards.
            # As DTensor reduces a sharded norm: the norm of what this rank holds (torch's
            # get_total_norm), squared, summed over the ranks by one all-reduce, square-rooted.
            import torch.distributed as dist

            from laplace.sharding import local_rows

            held = [local_rows(g)[0] for g in grads]
            squares = (torch.nn.utils.get_total_norm(held).float() ** 2).reshape(1)
            dist.all_reduce(squares, group=self.muon.group)
            norm = squares.sqrt()[0]
        else:
            # torch's get_total_norm (foreach where torch picks it, as clip_grad_norm_) over what this
            # rank holds: DTensor shards (a partial sum, all-reduced) or, on one rank, whole tensors
            sharded = [g for g in grads if isinstance(g, DTensor)]
            if sharded and len(sharded) < len(grads):  # one rank, owner_reduce: shards are whole here
                from laplace.sharding import local_rows

                grads = [local_rows(g)[0] for g in grads]
            norm = torch.nn.utils.get_total_norm(grads)
            if isinstance(norm, DTensor):  # a partial sum over the shards: all-reduced here
                norm = norm.full_tensor()
        if max_norm:  # DTensor and plain gradients apart: foreach cannot mix them
            for params in (
                [p for p in self.params if isinstance(p.grad, DTensor)],
                [p for p in self.params if p.grad is not None and not isinstance(p.grad, DTensor)],
            ):
                if params:
                    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    def step(self, max_grad_norm: float = 0.0) -> Tensor:
        """Clip, then one Muon and one AdamW step; returns the global gradient norm (a tensor)."""
        self.muon.reduce_gradients()  # owner_reduce: each Muon gradient onto its owner (else nothing)
        norm = self.clip_grad_norm_(max_grad_norm)
        self.muon.step()
        self.adamw.step()
        self.muon.broadcast_parameters()  # owner_reduce: the updated matrices from their owners
        return norm

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
