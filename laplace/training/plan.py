"""Dry run of distributed training: per-rank memory and Muon traffic, with nothing allocated.

The model is built on the meta device and sharded by FSDP2 (the trainer's own
`shard_model`) over torch's `fake` process group of the planned size, as torchtitan's
dry-run mode does: this process plays rank 0, every collective is a no-op, and the
DTensor shards have their real shapes. Rank 0 holds the largest shards (torch.chunk
gives the first ranks ceil(rows/W) rows), so its bytes are the per-rank maximum. The
Muon exchange is laid out by the optimizer's own `ExchangePlan`.

What is counted per rank: the fp32 master parameters and gradients (sharded), the AdamW
moments and Muon momentum (sharded), the Muon exchange buffers and the Newton-Schulz
workspace of the largest matrix the rank orthogonalises, and FSDP2's transient peak
(the root's parameters and gradients unsharded through the backward, two blocks'
gathered parameters and one block's unsharded gradients). Activations are not: what
is left of the device memory is their budget.
"""

from __future__ import annotations

import math

import torch

from laplace.model.config import ModelConfig
from laplace.model.lm import LaplaceLM
from laplace.optim.exchange import EXCHANGE_BYTES, ExchangePlan, muon_traffic
from laplace.optim.muon import route_parameters

GIB = 1024**3
# The article's Muon traffic per rank per optimizer step, Laplace 3B on 64 ranks.
ARTICLE = {"world_size": 64, "allgather_bytes": 10.87e9, "alltoall_bytes": 0.45e9}


def _newton_schulz_workspace(rows: int, cols: int, world: int, itemsize: int) -> int:
    """Bytes alive while an owner orthogonalises one matrix: the stacked shards, the padded result,
    and the iteration's x, x x^T, the polynomial and the next x (m <= n are the sides)."""
    m, n = min(rows, cols), max(rows, cols)
    stacked = -(-rows // world) * world * cols
    return itemsize * (rows * cols + stacked + 2 * m * n + 2 * m * m)


def plan(model_cfg: ModelConfig, world: int, precision: str = "bf16", hbm_gib: float = 24.0) -> dict:
    """Per-rank bytes and per-step Muon traffic of training `model_cfg` on `world` ranks."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from laplace.training.distributed import shard_model

    if dist.is_initialized():
        raise RuntimeError("plan() runs its own fake process group; call it outside a distributed job")
    dist.init_process_group("fake", rank=0, world_size=world)  # torch registers the backend and its store
    try:
        with torch.device("meta"):
            model = LaplaceLM(model_cfg)
        shard_model(model, init_device_mesh("cpu", (world,)), precision)
        routes = route_parameters(model)

        def local(p) -> int:
            return p.to_local().numel() if isinstance(p, DTensor) else p.numel()

        muon = [p for _, p in routes["muon"]]
        adamw = [p for r in ("adamw_decay", "adamw_no_decay") for _, p in routes[r]]
        sharded_values = sum(local(p) for p in muon + adamw)
        assert all(isinstance(p, DTensor) for p in muon + adamw), "FSDP2 left a parameter unsharded"
    finally:
        dist.destroy_process_group()

    shapes = [tuple(p.shape) for p in muon]
    exchange = ExchangePlan(shapes, world)
    ex_item = EXCHANGE_BYTES
    param_item = 2 if precision == "bf16" else 4
    owned = exchange.owned_by(0)
    block = sum(p.numel() for p in model.blocks[0].parameters())
    root = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("blocks."))
    per_rank = {
        "parameters": 4 * sharded_values,
        "gradients": 4 * sharded_values,
        "adamw_moments": 2 * 4 * sum(local(p) for p in adamw),
        "muon_momentum": 4 * sum(local(p) for p in muon),
        # send, received, back, returned: [W, segment] each
        "muon_exchange_buffers": 4 * world * exchange.segment * ex_item,
        "newton_schulz_workspace": max(
            (_newton_schulz_workspace(*b.shape, world, ex_item) for b, _ in owned), default=0
        ),
        # gathered in the param dtype; gradients unsharded in the param dtype plus their fp32 reduce copy
        "fsdp_transient_peak": root * (param_item + param_item + 4) + 2 * block * param_item + block * (param_item + 4),
    }
    total = sum(per_rank.values())
    hbm = int(hbm_gib * GIB)
    traffic = muon_traffic(shapes, world, ex_item)
    return {
        "world_size": world,
        "precision": precision,
        "params": model.num_parameters(),
        "muon_params": sum(math.prod(s) for s in shapes),
        "muon_matrices": len(shapes),
        "muon_matrices_owned_by_rank0": len(owned),
        "per_rank_bytes": per_rank,
        "per_rank_total_bytes": total,
        "device_memory_bytes": hbm,
        "left_for_activations_bytes": hbm - total,
        "fits": total < hbm,
        "muon_traffic": traffic,
        "article": ARTICLE if world == ARTICLE["world_size"] else None,
    }


def as_text(p: dict, name: str) -> str:
    gib = lambda b: f"{b / GIB:8.2f} GiB"  # noqa: E731
    gb = lambda b: f"{b / 1e9:8.3f} GB"  # noqa: E731
    labels = {
        "parameters": "parameters (fp32 master shards)",
        "gradients": "gradients (fp32 shards)",
        "adamw_moments": "AdamW moments (shards)",
        "muon_momentum": "Muon momentum (shards)",
        "muon_exchange_buffers": "Muon all-to-all buffers (bf16)",
        "newton_schulz_workspace": "Newton-Schulz workspace",
        "fsdp_transient_peak": "FSDP2 gathered params + grads",
    }
    count = lambda n: f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"  # noqa: E731
    t = p["muon_traffic"]
    ranks = f"{p['world_size']} rank{'s' if p['world_size'] > 1 else ''}"
    lines = [
        f"{name} on {ranks}, {p['precision']}: FSDP2 over torch's fake process group "
        "(rank 0, the largest shards; nothing allocated)",
        f"  {count(p['params'])} parameters, {count(p['muon_params'])} of them in {p['muon_matrices']} "
        f"Muon matrices ({p['muon_matrices_owned_by_rank0']} orthogonalised by rank 0)",
        "  per rank",
        *(f"    {labels[k]:<34}{gib(v)}" for k, v in p["per_rank_bytes"].items()),
        f"    {'total':<34}{gib(p['per_rank_total_bytes'])}",
        f"    {'device memory':<34}{gib(p['device_memory_bytes'])}",
        f"    {'left for activations':<34}{gib(p['left_for_activations_bytes'])}"
        + ("" if p["fits"] else "   (does NOT fit)"),
        f"  Muon traffic per rank per optimizer step ({t['bytes_per_value']}-byte values)",
        f"    {'':<34}{'ours':>11}" + (f"{'article':>14}" if p["article"] else ""),
        f"    {'allgather (every matrix everywhere)':<34}{gb(t['allgather_bytes_per_rank'])}"
        + (f"  {gb(p['article']['allgather_bytes'])}" if p["article"] else ""),
        f"    {'alltoall (owner ranks)':<34}{gb(t['alltoall_bytes_per_rank'])}"
        + (f"  {gb(p['article']['alltoall_bytes'])}" if p["article"] else ""),
        f"    {'  of which padding':<34}{gb(t['alltoall_bytes_per_rank'] - t['alltoall_unpadded_bytes_per_rank'])}",
    ]
    if t["ratio"]:
        article_ratio = p["article"]["allgather_bytes"] / p["article"]["alltoall_bytes"] if p["article"] else None
        lines.append(f"    {'ratio':<34}{t['ratio']:10.1f}x" + (f"  {article_ratio:11.1f}x" if article_ratio else ""))
    return "\n".join(lines)
