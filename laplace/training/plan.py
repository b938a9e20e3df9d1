"""Dry run of distributed training: per-rank memory and Muon traffic, with nothing allocated.

The model is built on the meta device and sharded by FSDP2 (the trainer's own
`shard_model`) over torch's `fake` process group of the planned size, as torchtitan's
dry-run mode does: this process plays rank 0, every collective is a no-op, and the
DTensor shards have their real shapes. Every other rank's shards follow from the same
rule (torch.chunk: ceil(rows/W) rows each, the last ranks fewer), checked against rank
0's; the Muon exchange is laid out by the optimizer's own `ExchangePlan` (laplace.optim.exchange,
arithmetic only), so each rank's Newton-Schulz workspace comes from the matrices it owns. Figures
are given for every rank: the maximum (what must fit) and the mean.

What is counted per rank: the fp32 master parameters and gradients (sharded), the AdamW
moments and Muon momentum (sharded), the Muon exchange buffers and the Newton-Schulz
workspace of the largest matrix the rank orthogonalises, and FSDP2's transient peak
(the root's parameters and gradients unsharded through the backward, two blocks'
gathered parameters and one block's unsharded gradients, in shard_model's units), the
unsharded gradient accumulators that gradient accumulation holds between micro-batches,
and the activations of one micro-batch at train.seq_len under each activation-
checkpointing mode (laplace.training.activations: measured with fake tensors and
saved-tensor hooks). It says the largest micro-batch that fits the device memory per mode
and the least recompute that fits.
"""

from __future__ import annotations

import math

import torch

from laplace.model.config import ModelConfig
from laplace.model.lm import LaplaceLM
from laplace.optim.exchange import EXCHANGE_BYTES, ExchangePlan, muon_traffic
from laplace.optim.muon import route_parameters
from laplace.training.activation_checkpoint import MODES
from laplace.training.activations import activation_bytes

GIB = 1024**3
# The article's Muon traffic per rank per optimizer step, Laplace 3B on 64 ranks.
ARTICLE = {"world_size": 64, "allgather_bytes": 10.87e9, "alltoall_bytes": 0.45e9}


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str, name: str = "size") -> int:
    """'24GiB', '80GB', '1.5 TiB', '512' (bytes) -> bytes; a ConfigError naming `name` otherwise."""
    import re

    from laplace.errors import ConfigError

    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ConfigError(f"{name}: expected a size such as 24GiB or 80GB, got {text!r}")
    return int(float(match.group(1)) * _UNITS[unit])


def _newton_schulz_workspace(rows: int, cols: int, world: int, itemsize: int) -> int:
    """Bytes alive while an owner orthogonalises one matrix: the stacked shards, the padded result,
    and the iteration's x, x x^T, the polynomial and the next x (m <= n are the sides)."""
    m, n = min(rows, cols), max(rows, cols)
    stacked = -(-rows // world) * world * cols
    return itemsize * (rows * cols + stacked + 2 * m * n + 2 * m * m)


def _rows(rows: int, world: int, rank: int) -> int:
    """FSDP2's shard of `rows` on `rank` (torch.chunk: ceil(rows / world) each, the last ranks fewer or none)."""
    per = -(-rows // world)
    return max(0, min(per, rows - rank * per))


def _local_values(shapes, world: int) -> list[int]:
    """Every rank's number of values of the parameters of these shapes, sharded by rows."""
    return [sum(_rows(s[0], world, r) * math.prod(s[1:]) for s in shapes) for r in range(world)]


def _fsdp_transient(model, param_item: int) -> int:
    """Gathered parameters and unsharded gradients at FSDP2's busiest moment (laplace.training.
    distributed.shard_model's units): a unit gathered in the param dtype, its gradients unsharded
    in the param dtype and an fp32 copy for the reduction (bf16), plus the next unit prefetched."""
    size = lambda *mods: sum(p.numel() for m in mods for p in m.parameters())  # noqa: E731
    block = size(model.blocks[0])
    grads = param_item + (4 if param_item != 4 else 0)
    if model.cfg.tie_embeddings:  # one unit, gathered through the whole step
        unit = size(model.embed, model.norm)
        return unit * param_item + max(unit * grads + block * param_item, 2 * block * param_item + block * grads)
    head, embed = size(model.norm, model.lm_head), size(model.embed)
    return max(
        head * (param_item + grads) + block * param_item,  # the head's backward, the last block prefetched
        2 * block * param_item + block * grads,  # a block's backward, the one before it prefetched
        embed * (param_item + grads),  # the embedding's backward, last
    )


# --------------------------------------------------------------------------- bytes per step, by mode

# The collectives' payload per rank, as bench/muon_comm.py's counting hook counts every call
# (sent = received for the symmetric ones; a ring moves the same):
#   all-gather of an s-byte shard: (W-1) s each way; reduce-scatter to an s-byte shard: (W-1) s
#   each way; reduce / broadcast of S bytes: S one way on the non-root ranks, (W-1) S on the root.
STEP_MODES = ("owner_reduce", "alltoall", "adamw_zero")


def _padded_shard_values(shape: tuple[int, ...], world: int) -> int:
    """FSDP2's all-gather input for one parameter: its shard padded to ceil(rows / W) rows."""
    return -(-shape[0] // world) * math.prod(shape[1:])


def _fsdp_units(model) -> list[tuple[list[tuple[str, torch.nn.Parameter]], int]]:
    """shard_model's units, each with its parameters and its all-gathers per step: 2 for a unit
    resharded after its forward (gathered again for its backward), 1 for the one kept (the head)."""
    names = {id(p): n for n, p in model.named_parameters()}
    params = lambda *mods: [(names[id(p)], p) for m in mods for p in m.parameters()]  # noqa: E731
    units = []
    if model.cfg.tie_embeddings:
        units.append((params(model.embed, model.norm, model.lm_head), 1))
    else:
        units += [(params(model.embed), 2), (params(model.norm, model.lm_head), 1)]
    units += [(params(block), 2) for block in model.blocks]
    seen: set[int] = set()  # a tied weight once
    return [([(n, p) for n, p in u if id(p) not in seen and not seen.add(id(p))], g) for u, g in units]


def step_traffic(model, world: int, precision: str = "fp32") -> dict:
    """Bytes every rank sends and receives per optimizer step (one micro-batch), by mode and kind:
    gradients (FSDP2's reduce-scatters; owner_reduce: the Muon gradients' reduces to their owners),
    parameters (FSDP2's all-gathers; owner_reduce: the updated Muon matrices' broadcasts) and the
    optimizer's own exchange (alltoall: its two all-to-alls; owner_reduce and AdamW-ZeRO: none).
    AdamW-ZeRO: every parameter under FSDP2 and AdamW, no Muon. Every rank's figure, in a list.
    `model` may live on the meta device (only shapes are read)."""
    from laplace.optim.exchange import owner_reduce_traffic

    param_item = 2 if precision == "bf16" else 4
    muon_names = {n for n, _ in route_parameters(model)["muon"]}
    shapes = [tuple(p.shape) for _, p in route_parameters(model)["muon"]]
    others = world - 1

    def fsdp(skip: set[str]) -> tuple[list[int], list[int]]:
        grads = params = 0
        for members, gathers in _fsdp_units(model):
            shard = sum(_padded_shard_values(tuple(p.shape), world) for n, p in members if n not in skip)
            grads += 2 * others * shard * 4  # reduce dtype fp32
            params += gathers * 2 * others * shard * param_item
        return [grads] * world, [params] * world

    out = {}
    grads, params = fsdp(set())
    out["adamw_zero"] = {"gradients": grads, "parameters": params, "optimizer": [0] * world}
    a2a = muon_traffic(shapes, world, EXCHANGE_BYTES)["alltoall_bytes_per_rank"] if world > 1 else 0
    out["alltoall"] = {"gradients": grads, "parameters": params, "optimizer": [a2a] * world}
    if precision == "fp32":  # owner_reduce applies (laplace.training.distributed.owner_reduce_applies)
        grads, params = fsdp(muon_names)
        owner = owner_reduce_traffic(shapes, world, 4)
        out["owner_reduce"] = {
            "gradients": [g + r["sent"] + r["received"] for g, r in zip(grads, owner["gradient_reduce"])],
            "parameters": [q + r["sent"] + r["received"] for q, r in zip(params, owner["parameter_broadcast"])],
            "optimizer": [0] * world,
        }
    for figures in out.values():
        kinds = ("gradients", "parameters", "optimizer")
        figures["total"] = [sum(column) for column in zip(*(figures[k] for k in kinds))]
    return out


def plan(
    model_cfg: ModelConfig,
    world: int,
    precision: str = "bf16",
    hbm_gib: float = 24.0,
    *,
    seq_len: int = 2048,
    micro_batch: int = 1,
    grad_accum_steps: int = 1,
    activation_checkpoint: str = "none",
) -> dict:
    """Per-rank bytes (every rank's: max and mean) and per-step Muon traffic of training
    `model_cfg` on `world` ranks with micro-batches of `micro_batch` x `seq_len` tokens,
    and the activations of each activation-checkpointing mode."""
    model, muon, adamw = _sharded_on_fake_ranks(model_cfg, world, precision)
    shapes = [tuple(p.shape) for p in muon]
    exchange = ExchangePlan(shapes, world)
    n_params = model.num_parameters()
    by_mode = step_traffic(model, world, precision)
    ranks = _rank_bytes(model, muon, adamw, exchange, world, precision, grad_accum_steps)
    totals = [sum(column) for column in zip(*ranks.values())]
    busiest = max(range(world), key=totals.__getitem__)
    per_rank = {k: v[0] for k, v in ranks.items()}
    hbm = int(hbm_gib * GIB)
    traffic = muon_traffic(shapes, world, EXCHANGE_BYTES)

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    static = max(totals)
    one, modes = _activation_modes(model_cfg, seq_len, micro_batch, dtype, static, hbm)
    growth = activation_growth(model_cfg, seq_len, dtype, activation_checkpoint, one)
    # the least recompute that fits: none, then selective (recomputes the cheap ops), then full
    needs = next((m for m in ("none", "selective", "full") if modes[m]["fits"]), None)
    return {
        "world_size": world,
        "precision": precision,
        "params": n_params,
        "muon_params": sum(math.prod(s) for s in shapes),
        "muon_matrices": len(shapes),
        "per_rank_bytes": per_rank,
        "per_rank_max_bytes": {k: max(v) for k, v in ranks.items()},
        "per_rank_mean_bytes": {k: sum(v) / world for k, v in ranks.items()},
        "per_rank_total_bytes": totals[0],
        "per_rank_total_max_bytes": static,
        "per_rank_total_mean_bytes": sum(totals) / world,
        "busiest_rank": busiest,
        "device_memory_bytes": hbm,
        "left_for_activations_bytes": hbm - static,
        "seq_len": seq_len,
        "micro_batch": micro_batch,
        "grad_accum_steps": grad_accum_steps,
        "activations": one,
        "activation_growth": growth,
        "activation_checkpoint": activation_checkpoint,
        "modes": modes,
        "needs_activation_checkpoint": needs,
        "fits": modes[activation_checkpoint]["fits"],
        "muon_traffic": traffic,
        "step_traffic": {mode: _max_and_mean(kinds, world) for mode, kinds in by_mode.items()},
        "muon_memory": {mode: _max_and_mean(kinds, world) for mode, kinds in _muon_memory(exchange, world).items()},
        "article": ARTICLE if world == ARTICLE["world_size"] else None,
    }


def _max_and_mean(kinds: dict[str, list[int]], world: int) -> dict[str, dict[str, float]]:
    return {kind: {"max": max(v), "mean": sum(v) / world} for kind, v in kinds.items()}


def _sharded_on_fake_ranks(model_cfg: ModelConfig, world: int, precision: str) -> tuple:
    """The model on the meta device, sharded by the trainer's shard_model over torch's fake process
    group of `world` ranks (this process is rank 0), and its Muon and AdamW parameters; every
    rank's shard arithmetic checked against FSDP2's rank 0."""
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
        rank0_values = sum(local(p) for p in muon + adamw)
        assert all(isinstance(p, DTensor) for p in muon + adamw), "FSDP2 left a parameter unsharded"
    finally:
        dist.destroy_process_group()
    values = _local_values([tuple(p.shape) for p in muon + adamw], world)
    assert values[0] == rank0_values, "the shard arithmetic disagrees with FSDP2's rank 0"
    return model, muon, adamw


def _workspace_per_rank(exchange: ExchangePlan, world: int, stacked_from: int) -> list[int]:
    """Every rank's Newton-Schulz workspace: that of the largest matrix it owns, stacked from
    `stacked_from` shards (the world's under alltoall; 1, the matrix whole, under owner_reduce)."""
    return [
        max((_newton_schulz_workspace(*s.shape, stacked_from, EXCHANGE_BYTES) for s in exchange.owned_by(r)), default=0)
        for r in range(world)
    ]


def _rank_bytes(
    model, muon: list, adamw: list, exchange: ExchangePlan, world: int, precision: str, grad_accum_steps: int
) -> dict[str, list[int]]:
    """Every rank's bytes before activations, by memory part (the parts as_text names)."""
    values = _local_values([tuple(p.shape) for p in muon + adamw], world)
    adamw_values = _local_values([tuple(p.shape) for p in adamw], world)
    muon_values = _local_values([tuple(p.shape) for p in muon], world)
    param_item = 2 if precision == "bf16" else 4
    return {
        "parameters": [4 * v for v in values],
        "gradients": [4 * v for v in values],
        "adamw_moments": [2 * 4 * v for v in adamw_values],
        "muon_momentum": [4 * v for v in muon_values],
        # send, received, back, returned: [W, segment] each
        # one rank exchanges nothing: it holds only the orthogonalised updates (ShardedMuon.step)
        "muon_exchange_buffers": [(4 * world if world > 1 else 1) * exchange.segment * EXCHANGE_BYTES] * world,
        "newton_schulz_workspace": _workspace_per_rank(exchange, world, world),
        "fsdp_transient_peak": [_fsdp_transient(model, param_item)] * world,
        # grad_accum_steps > 1: FSDP2 reduce-scatters on the last micro-batch only, so until then every
        # parameter's gradient is held unsharded, in the reduce dtype (fp32)
        "unsharded_gradient_accumulators": [4 * model.num_parameters() if grad_accum_steps > 1 else 0] * world,
    }


def _muon_memory(exchange: ExchangePlan, world: int) -> dict[str, dict[str, list[int]]]:
    """Every rank's Muon state by muon.comm: alltoall's row shards of the matrices, their gradients
    and momentum, against owner_reduce's (fp32): every Muon matrix whole on every rank, its
    gradient whole on every rank until the reduce, its momentum whole on its owner."""
    shapes = exchange.shapes
    muon_values = _local_values(shapes, world)
    owned_bytes = [0] * world
    for slot in exchange.slots:
        owned_bytes[slot.owner] += 4 * math.prod(slot.shape)
    muon_whole = 4 * sum(math.prod(s) for s in shapes)
    return {
        "alltoall": {
            "muon_parameters": [4 * v for v in muon_values],
            "muon_gradients_until_reduced": [4 * v for v in muon_values],
            "muon_momentum": [4 * v for v in muon_values],
            "newton_schulz_workspace": _workspace_per_rank(exchange, world, world),
        },
        "owner_reduce": {
            "muon_parameters": [muon_whole] * world,
            "muon_gradients_until_reduced": [muon_whole] * world,
            "muon_momentum": owned_bytes,
            "newton_schulz_workspace": _workspace_per_rank(exchange, world, 1),
        },
    }


def _activation_modes(
    model_cfg: ModelConfig, seq_len: int, micro_batch: int, dtype: torch.dtype, static: int, hbm: int
) -> tuple[dict, dict[str, dict]]:
    """One sequence's activations at seq_len, and per activation-checkpointing mode a micro-batch's,
    the total beside the `static` bytes, whether it fits `hbm` and the largest micro-batch that does."""
    one = activation_bytes(model_cfg, 1, seq_len, dtype)  # every figure is linear in the micro-batch
    modes = {}
    for mode in MODES:
        per_sequence = one["peak_bytes"][mode] + one["logits_gradient_bytes"]
        acts = micro_batch * per_sequence
        modes[mode] = {
            "activation_bytes_per_sequence": per_sequence,
            "activation_bytes": acts,
            "total_bytes": static + acts,
            "fits": static + acts <= hbm,
            "max_micro_batch": max(0, (hbm - static) // per_sequence),
        }
    return one, modes


def activation_growth(
    model_cfg: ModelConfig, seq_len: int, dtype: torch.dtype, mode: str, at_seq_len: dict | None = None
) -> dict[int, dict]:
    """Activations of one sequence at seq_len, 2x and 4x, in `mode`: how they grow with the
    length (linearly for GLA; an attention layer adds what its softmax keeps, O(T) fused or O(T^2)
    materialised), and the attention blocks' part of it."""
    out = {}
    for n in (seq_len, 2 * seq_len, 4 * seq_len):
        a = at_seq_len if n == seq_len and at_seq_len else activation_bytes(model_cfg, 1, n, dtype)
        out[n] = {
            "activation_bytes": a["peak_bytes"][mode] + a["logits_gradient_bytes"],
            "attention_block_saved_bytes": sum(a["attention_block_saved_bytes"]),
        }
    return out


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
        "unsharded_gradient_accumulators": "grad accumulators (unsharded)",
    }
    count = lambda n: f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"  # noqa: E731
    t = p["muon_traffic"]
    ranks = f"{p['world_size']} rank{'s' if p['world_size'] > 1 else ''}"
    lines = [
        f"{name} on {ranks}, {p['precision']}: FSDP2 over torch's fake process group "
        "(rank 0, the largest shards; nothing allocated)",
        f"  {count(p['params'])} parameters, {count(p['muon_params'])} of them in {p['muon_matrices']} "
        f"Muon matrices (owners by bytes: {t['owned_matrices_per_rank_max']} per rank at most, "
        f"{t['owned_matrices_per_rank_mean']:.2f} on average)",
        f"  per rank, max over the {ranks} (mean)",
        *(
            f"    {labels[k]:<34}{gib(v)}  ({gib(p['per_rank_mean_bytes'][k]).strip()})"
            for k, v in p["per_rank_max_bytes"].items()
        ),
        f"    {'total before activations':<34}{gib(p['per_rank_total_max_bytes'])}  "
        f"({gib(p['per_rank_total_mean_bytes']).strip()}; busiest: rank {p['busiest_rank']})",
        f"    {'device memory':<34}{gib(p['device_memory_bytes'])}",
        f"    {'left for activations':<34}{gib(p['left_for_activations_bytes'])}",
        f"  activations of one micro-batch of {p['micro_batch']} x {p['seq_len']} tokens "
        f"(grad_accum_steps {p['grad_accum_steps']})",
        f"    {'train.activation_checkpoint':<28}{'activations':>12}{'total':>12}  fits  largest micro-batch",
        *(
            f"    {mode + (' (set)' if mode == p['activation_checkpoint'] else ''):<28}"
            f"{gib(m['activation_bytes'])}{gib(m['total_bytes'])}  {'yes ' if m['fits'] else 'NO  '}"
            f"  {m['max_micro_batch']} x {p['seq_len']}"
            for mode, m in p["modes"].items()
        ),
        (
            f"    needs train.activation_checkpoint: {p['needs_activation_checkpoint']}"
            if p["needs_activation_checkpoint"]
            else "    does NOT fit in any mode: more ranks, a shorter train.seq_len or a smaller micro-batch"
        ),
        f"  activations of one sequence as it grows ({p['activation_checkpoint']}; of which attention blocks save)",
        *(
            # int(n): the keys are strings once the plan has been through --json
            f"    {int(n):>8,} tokens{'':<19}{gib(g['activation_bytes'])}  "
            f"({gib(g['attention_block_saved_bytes']).strip()})"
            for n, g in p["activation_growth"].items()
        ),
        f"  Muon traffic per rank per optimizer step ({t['bytes_per_value']}-byte values)",
        f"    {'':<34}{'ours':>11}" + (f"{'article':>14}" if p["article"] else ""),
        f"    {'allgather (every matrix everywhere)':<34}{gb(t['allgather_bytes_per_rank'])}"
        + (f"  {gb(p['article']['allgather_bytes'])}" if p["article"] else ""),
        f"    {'alltoall (owner ranks)':<34}{gb(t['alltoall_bytes_per_rank'])}"
        + (f"  {gb(p['article']['alltoall_bytes'])}" if p["article"] else ""),
        f"    {'  of which padding':<34}{gb(t['alltoall_bytes_per_rank'] - t['alltoall_unpadded_bytes_per_rank'])}",
        f"    {'  every rank (max / mean)':<34}{gb(t['alltoall_bytes_per_rank_max'])} / "
        f"{t['alltoall_bytes_per_rank_mean'] / 1e9:.3f} GB (equal splits)",
    ]
    if t["ratio"]:
        article_ratio = p["article"]["allgather_bytes"] / p["article"]["alltoall_bytes"] if p["article"] else None
        lines.append(f"    {'ratio':<34}{t['ratio']:10.1f}x" + (f"  {article_ratio:11.1f}x" if article_ratio else ""))
    lines += [
        f"  Newton-Schulz per rank per step (max / mean over the {p['world_size']} ranks)",
        f"    {'FLOPs':<34}{t['newton_schulz_flops_per_rank_max'] / 1e12:8.2f} / "
        f"{t['newton_schulz_flops_per_rank_mean'] / 1e12:.2f} TFLOP"
        + (f"   max/mean {t['newton_schulz_work_max_over_mean']:.3f}" if t["newton_schulz_work_max_over_mean"] else ""),
        f"    {'Muon values owned':<34}{count(t['owned_values_per_rank_max']):>11} / "
        f"{count(t['owned_values_per_rank_mean'])}",
    ]
    lines += _modes_text(p)
    return "\n".join(lines)


def _modes_text(p: dict) -> list[str]:
    """Bytes per rank per step by muon.comm, beside AdamW-ZeRO's, and what owner_reduce costs in memory."""
    gb = lambda b: f"{b / 1e9:9.3f}"  # noqa: E731
    gib = lambda b: f"{b / GIB:9.2f}"  # noqa: E731
    names = {"owner_reduce": "owner_reduce", "alltoall": "alltoall", "adamw_zero": "AdamW-ZeRO (no Muon)"}
    lines = [
        "  bytes per rank per optimizer step, sent + received, GB, max over the ranks (mean)",
        f"    {'':<24}{'gradients':>18}{'parameters':>18}{'optimizer':>18}{'total':>18}",
    ]
    for mode, kinds in p["step_traffic"].items():
        cells = "".join(f"{gb(kinds[k]['max'])} ({kinds[k]['mean'] / 1e9:.3f})" for k in ("gradients", "parameters"))
        cells += "".join(f"{gb(kinds[k]['max'])} ({kinds[k]['mean'] / 1e9:.3f})" for k in ("optimizer", "total"))
        lines.append(f"    {names[mode]:<24}{cells}")
    if "owner_reduce" not in p["step_traffic"]:
        lines.append("    owner_reduce: fp32 only (bf16 runs use alltoall)")
    lines.append("  Muon memory per rank, GiB, max (mean): alltoall row shards vs owner_reduce whole matrices")
    mem = p["muon_memory"]
    for kind in mem["alltoall"]:
        a, o = mem["alltoall"][kind], mem["owner_reduce"][kind]
        cells = f"{gib(a['max'])} ({a['mean'] / GIB:.2f}){gib(o['max'])} ({o['mean'] / GIB:.2f})"
        lines.append(f"    {kind.replace('_', ' '):<34}{cells}")
    return lines
