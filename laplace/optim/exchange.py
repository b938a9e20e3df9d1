"""The Muon exchange as arithmetic: which rank orthogonalises which matrix, where each matrix
sits in the all-to-all buffers, and the bytes every rank moves per optimizer step.

Depends only on the matrices' shapes and the world size, so every rank builds the same plan,
and `laplace plan` (laplace.training.plan) reads the traffic of a 3B run on 64 ranks without
a process group or an optimizer. laplace.optim.sharded runs the plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from laplace.optim.muon import newtonschulz_flops, route_parameters

COLLECTIVES = ("muon_to_owner", "muon_from_owner", "muon_allgather", "muon_grad_reduce", "muon_param_broadcast")
EXCHANGE_BYTES = 2  # bf16 on the wire (Newton-Schulz casts to bf16 first anyway)


# --------------------------------------------------------------------------- the exchange plan


@dataclass(frozen=True)
class Slot:
    """Where one matrix travels in `alltoall`: every rank sends its row shard, padded to `rows`,
    to `owner`, at `offset` of the segment it sends that owner; the owner orthogonalises it."""

    index: int  # into the optimizer's matrix list
    shape: tuple[int, int]
    owner: int
    rows: int  # every rank's row shard, padded: ceil(R / W) (torch.chunk's rule, FSDP2's)
    offset: int

    @property
    def chunk(self) -> int:
        """Values each rank sends the owner for this matrix (its padded row shard)."""
        return self.rows * self.shape[1]


@dataclass
class ExchangePlan:
    """How `alltoall` packs every matrix into one equal-split all-to-all, and `allgather` into
    one all-gather. Depends only on the shapes and W, so every rank builds the same plan.

    Owners are chosen by bytes, largest matrix first, each to the rank with the least so far
    (LPT scheduling, Graham's 4/3 bound), whatever the shapes. An owner's matrices sit one after
    another in the segment every rank sends it; all-to-all splits must be equal, so every
    segment is as long as the busiest owner's and the rest of a shorter one is padding. The
    earlier plan (matrices of one shape in batches of W, one owner each) padded the last batch
    of every shape: 0.249 of 0.584 GB per rank per step at 3B on 64 ranks; this one pads 0.06."""

    shapes: list[tuple[int, int]]
    world: int
    slots: list[Slot] = field(default_factory=list)  # in matrix order
    segment: int = 0  # values each rank sends to (and receives from) each rank, per all-to-all
    loads: list[int] = field(default_factory=list)  # values each owner receives from each rank
    allgather_offsets: list[int] = field(default_factory=list)
    allgather_segment: int = 0  # values each rank contributes to the all-gather

    def __post_init__(self):
        W = self.world
        self.shapes = [tuple(s) for s in self.shapes]
        rows = [-(-r // W) for r, _ in self.shapes]
        chunks = [n * c for n, (_, c) in zip(rows, self.shapes)]
        self.loads = [0] * W
        placed: dict[int, Slot] = {}
        for i in sorted(range(len(self.shapes)), key=lambda i: (-chunks[i], i)):
            owner = min(range(W), key=lambda r: (self.loads[r], r))
            placed[i] = Slot(i, self.shapes[i], owner, rows[i], self.loads[owner])
            self.loads[owner] += chunks[i]
        self.slots = [placed[i] for i in range(len(self.shapes))]
        self.segment = max(self.loads, default=0)
        for n, (_, cols) in zip(rows, self.shapes):
            self.allgather_offsets.append(self.allgather_segment)
            self.allgather_segment += n * cols

    @property
    def padding(self) -> int:
        """Values of padding in one rank's all-to-all send buffer (beyond the padded row shards)."""
        return self.world * self.segment - sum(self.loads)

    def owned_by(self, rank: int) -> list[Slot]:
        """The slots of every matrix `rank` orthogonalises."""
        return [s for s in self.slots if s.owner == rank]

    def newton_schulz_work(self, ns_steps: int = 5) -> list[int]:
        """Newton-Schulz FLOPs per optimizer step of every rank (its owned matrices, whole)."""
        work = [0] * self.world
        for s in self.slots:
            work[s.owner] += newtonschulz_flops(*s.shape, ns_steps)
        return work


# --------------------------------------------------------------------------- traffic


def traffic_metrics(gathered: dict[str, dict[str, list[int]]], steps: int) -> dict:
    """Per-rank Muon bytes per optimizer step: by collective, and in total (sent + received)."""
    world = len(next(iter(gathered.values()))["sent"])
    per_rank = {c: [(v["sent"][r] + v["received"][r]) / steps for r in range(world)] for c, v in gathered.items()}
    muon = [sum(per_rank[c][r] for c in per_rank) for r in range(world)]
    out = {f"{c}_bytes_per_rank_per_step_max": max(v) for c, v in per_rank.items() if max(v) > 0}
    out["muon_bytes_per_rank_per_step_max"] = max(muon)
    out["muon_bytes_per_rank_per_step_mean"] = sum(muon) / world
    return out


def muon_traffic(
    shapes: list[tuple[int, int]], world: int, bytes_per_value: int = EXCHANGE_BYTES, ns_steps: int = 5
) -> dict:
    """Muon bytes per rank (sent + received) of one optimizer step for matrices of these shapes,
    and every rank's Newton-Schulz work, from the plan the optimizer runs. Splits are equal, so
    every rank moves the same bytes (max = mean); the payload, the owned matrices and the work
    differ by rank: max and mean over every rank, not one rank's."""
    plan = ExchangePlan([tuple(s) for s in shapes], world)
    values = sum(r * c for r, c in plan.shapes)
    others = world - 1
    total_load = sum(plan.loads)
    # two all-to-alls (to the owners and back), each one sent and one received segment per other rank
    moved = [2 * 2 * others * plan.segment * bytes_per_value for _ in range(world)]
    # without the padding: what rank r's owned shards bring in, plus what it sends the other owners
    payload = [2 * (others * load + total_load - load) * bytes_per_value if others else 0 for load in plan.loads]
    allgather = 2 * others * plan.allgather_segment * bytes_per_value
    # what the same exchange would move with no padding at all (the ideal the article's figures assume)
    unpadded_alltoall = 2 * 2 * values * others / world / world * bytes_per_value if world > 1 else 0
    work = plan.newton_schulz_work(ns_steps)
    owned = [len(plan.owned_by(r)) for r in range(world)]
    owned_values = [0] * world
    for slot in plan.slots:
        owned_values[slot.owner] += slot.shape[0] * slot.shape[1]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {
        "world_size": world,
        "muon_matrices": len(plan.shapes),
        "muon_values": values,
        "bytes_per_value": bytes_per_value,
        "segment_values": plan.segment,
        "padding_values": plan.padding,
        "alltoall_bytes_per_rank": max(moved, default=0),
        "alltoall_bytes_per_rank_max": max(moved, default=0),
        "alltoall_bytes_per_rank_mean": mean(moved),
        "alltoall_payload_bytes_per_rank_max": max(payload, default=0),
        "alltoall_payload_bytes_per_rank_mean": mean(payload),
        "allgather_bytes_per_rank": allgather,
        "alltoall_unpadded_bytes_per_rank": unpadded_alltoall,
        "ratio": allgather / moved[0] if moved and moved[0] else None,
        "ideal_ratio": world / 2,
        "owned_matrices_per_rank_max": max(owned, default=0),
        "owned_matrices_per_rank_mean": mean(owned),
        "owned_values_per_rank_max": max(owned_values, default=0),
        "owned_values_per_rank_mean": mean(owned_values),
        "newton_schulz_flops_per_rank_max": max(work, default=0),
        "newton_schulz_flops_per_rank_mean": mean(work),
        "newton_schulz_work_max_over_mean": max(work) / mean(work) if any(work) else None,
    }


def owner_reduce_traffic(
    shapes: list[tuple[int, int]], world: int, bytes_per_value: int = 4, ns_steps: int = 5
) -> dict:
    """muon.comm owner_reduce, per rank per step: every Muon gradient reduced onto its owner and
    every updated matrix broadcast from it (fp32, whole tensors: no padding), with the owners
    `ExchangePlan` chooses. Counted as the collectives' payload: a reduce's non-root ranks send
    the tensor once and its root receives it from each of the others; a broadcast the reverse
    (how bench/muon_comm.py's counting hook counts them). Nothing moves in the optimizer step."""
    plan = ExchangePlan([tuple(s) for s in shapes], world)
    sizes = [r * c * bytes_per_value for r, c in plan.shapes]
    others = world - 1
    total = sum(sizes)
    owned = [0] * world
    for slot, size in zip(plan.slots, sizes):
        owned[slot.owner] += size
    if not others:
        grad = [{"sent": 0, "received": 0} for _ in range(world)]
    else:
        grad = [{"sent": total - owned[r], "received": others * owned[r]} for r in range(world)]
    param = [{"sent": g["received"], "received": g["sent"]} for g in grad]  # the way back mirrors it
    per_rank = [g["sent"] + g["received"] + p["sent"] + p["received"] for g, p in zip(grad, param)]
    work = plan.newton_schulz_work(ns_steps)
    counts = [len(plan.owned_by(r)) for r in range(world)]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {
        "world_size": world,
        "bytes_per_value": bytes_per_value,
        "gradient_reduce": grad,
        "parameter_broadcast": param,
        "optimizer_bytes_per_rank": 0,
        "bytes_per_rank": per_rank,
        "bytes_per_rank_max": max(per_rank),
        "bytes_per_rank_mean": mean(per_rank),
        "padding_values": 0,
        "owned_matrices": counts,
        "owned_bytes_per_rank_max": max(owned),
        "owned_bytes_per_rank_mean": mean(owned),
        "newton_schulz_flops_per_rank_max": max(work, default=0),
        "newton_schulz_flops_per_rank_mean": mean(work),
        "newton_schulz_work_max_over_mean": max(work) / mean(work) if any(work) else None,
    }


def model_traffic(model: nn.Module, world: int, bytes_per_value: int = EXCHANGE_BYTES) -> dict:
    """`muon_traffic` of a model's Muon matrices (works on the meta device: only shapes are read)."""
    return muon_traffic([tuple(p.shape) for _, p in route_parameters(model)["muon"]], world, bytes_per_value)
