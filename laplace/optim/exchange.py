"""The Muon exchange as arithmetic: which rank orthogonalises which matrix, where each matrix
sits in the all-to-all buffers, and the bytes every rank moves per optimizer step.

Depends only on the matrices' shapes and the world size, so every rank builds the same plan,
and `laplace plan` (laplace.training.plan) reads the traffic of a 3B run on 64 ranks without
a process group or an optimizer. laplace.optim.sharded runs the plan.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from torch import nn

from laplace.optim.muon import route_parameters

COLLECTIVES = ("muon_to_owner", "muon_from_owner", "muon_allgather")
EXCHANGE_BYTES = 2  # bf16 on the wire (Newton-Schulz casts to bf16 first anyway)


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


def traffic_metrics(gathered: dict[str, dict[str, list[int]]], steps: int) -> dict:
    """Per-rank Muon bytes per optimizer step: by collective, and in total (sent + received)."""
    world = len(next(iter(gathered.values()))["sent"])
    per_rank = {c: [(v["sent"][r] + v["received"][r]) / steps for r in range(world)] for c, v in gathered.items()}
    muon = [sum(per_rank[c][r] for c in per_rank) for r in range(world)]
    out = {f"{c}_bytes_per_rank_per_step_max": max(v) for c, v in per_rank.items() if max(v) > 0}
    out["muon_bytes_per_rank_per_step_max"] = max(muon)
    out["muon_bytes_per_rank_per_step_mean"] = sum(muon) / world
    return out


def muon_traffic(shapes: list[tuple[int, int]], world: int, bytes_per_value: int = EXCHANGE_BYTES) -> dict:
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


def model_traffic(model: nn.Module, world: int, bytes_per_value: int = EXCHANGE_BYTES) -> dict:
    """`muon_traffic` of a model's Muon matrices (works on the meta device: only shapes are read)."""
    return muon_traffic([tuple(p.shape) for _, p in route_parameters(model)["muon"]], world, bytes_per_value)
