"""Rows of a tensor FSDP2 may have sharded: the model's initialisation, model.init's loading and
the sharded Muon all read or write only the rows this process holds. A base module, because the
model and the optimizer both need it and neither may import the other's room."""

from __future__ import annotations

from torch import Tensor


def local_rows(t: Tensor) -> tuple[Tensor, int]:
    """(the rows of `t` this process holds, the global index of the first). A plain tensor is
    whole; FSDP2 shards parameters, their gradients and optimizer state by rows over a 1-D mesh,
    torch.chunk's rule: rank r holds rows [r*c, (r+1)*c), c = ceil(rows / world), the last
    ranks fewer or none."""
    from torch.distributed.tensor import DTensor, Shard  # lazy: importing the model need not load it

    if not isinstance(t, DTensor):
        return t, 0
    if t.device_mesh.ndim != 1 or tuple(t.placements) != (Shard(0),):
        raise ValueError(f"expected a tensor row-sharded over a 1-D mesh, got placements {t.placements}")
    per_rank = -(-t.shape[0] // t.device_mesh.size())
    return t.to_local(), t.device_mesh.get_local_rank() * per_rank
