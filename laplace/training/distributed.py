"""torch.distributed plumbing: the process group of a training run and the torchrun command.

Training always runs in a process group, so there is one code path and one checkpoint
format for every world size: under torchrun the group comes from the environment
torchrun sets (gloo on CPU, nccl on CUDA, the neuron backend on Trainium); a plain
single process gets a one-rank gloo group over an in-memory store.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from laplace.config import TrainSection


@dataclass
class Group:
    rank: int
    world: int
    local_rank: int
    created: bool  # this call initialised the group (and must destroy it)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def backend_for(device: torch.device) -> str:
    return {"cuda": "nccl", "neuron": "neuron"}.get(device.type, "gloo")


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("WORLD_SIZE" in os.environ and "RANK" in os.environ)


def join(device: torch.device) -> Group:
    """Join (or create) the default process group."""
    if dist.is_initialized():
        return Group(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)), False)
    if launched_by_torchrun():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store, _, _ = next(dist.rendezvous("env://", rank, world))  # torchrun's store, as env:// would
        # After a restart torchrun may hand out the same store, still holding the dead workers'
        # addresses: a rank that reads one first times out connecting. Keys per attempt avoid that.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(
            backend_for(device),
            store=dist.PrefixStore(f"laplace/attempt_{attempt}", store),
            rank=rank,
            world_size=world,
        )
    else:  # one rank, no network: an in-memory store
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return Group(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)), True)


def leave(group: Group) -> None:
    if group.created and dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def broadcast_int(value: int, src: int = 0) -> int:
    t = torch.tensor([value], dtype=torch.long)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(t, src)
    return int(t.item())


def all_mean(value: torch.Tensor) -> torch.Tensor:
    """Mean of a scalar across ranks (every rank gets the same value)."""
    v = value.detach().double().reshape(1).clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(v)
        v /= dist.get_world_size()
    return v[0]


def needs_torchrun(t: TrainSection) -> bool:
    return (t.nproc_per_node > 1 or t.nnodes > 1) and not launched_by_torchrun()


def torchrun_launcher(t: TrainSection) -> list[str]:
    """`torchrun ...` from the train section (standalone unless a rendezvous endpoint is set); the
    module and its arguments follow."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={t.nproc_per_node}",
        f"--max-restarts={t.max_restarts}",
    ]
    if t.rdzv_endpoint:
        cmd += [
            f"--nnodes={t.nnodes}",
            f"--node-rank={t.node_rank}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={t.rdzv_endpoint}",
            f"--rdzv-id={t.rdzv_id}",
        ]
    else:
        cmd += ["--standalone"]
    return cmd
