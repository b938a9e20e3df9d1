"""torch.distributed plumbing: the process group of a training run, FSDP2 sharding, the
collective checks every rank must agree on, and the torchrun command.

Training always runs in a process group, so there is one code path and one checkpoint
format for every world size: under torchrun the group comes from the environment
torchrun sets (gloo on CPU, nccl on CUDA, the neuron backend on Trainium); a plain
single process gets a one-rank gloo group over an in-memory store.

Backends that serve only an accelerator (NCCL: cuda; TorchNeuron: neuron) reject host
tensors, so every tensor handed to a collective here lives on the training device, and
none is fp64 (Trainium has none). Verdicts ranks must share (a bad input, a missing
shared directory) are agreed collectively, so every rank stops together with a clear
line instead of one rank exiting while the others wait in a collective.
"""

from __future__ import annotations

import functools
import hashlib
import os
import secrets
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from laplace.config import TrainSection
from laplace.errors import InputError, PeerInputError


@dataclass
class Group:
    rank: int
    world: int
    local_rank: int
    device: torch.device  # where every tensor a collective sees lives
    created: bool  # this call initialised the group (and must destroy it)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def backend_for(device: torch.device) -> str:
    return {"cuda": "nccl", "neuron": "neuron"}.get(device.type, "gloo")


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("WORLD_SIZE" in os.environ and "RANK" in os.environ)


def join(device: torch.device) -> Group:
    """Join (or create) the default process group; on CUDA each rank takes its local device."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device.type != "cpu" and device.index is None and torch.accelerator.is_available():
        device = torch.device(device.type, local_rank % max(1, torch.accelerator.device_count()))
        torch.accelerator.set_device_index(device.index)
    if dist.is_initialized():
        return Group(dist.get_rank(), dist.get_world_size(), local_rank, device, False)
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
            device_id=device if device.type == "cuda" else None,  # NCCL binds its communicator to it
        )
    else:  # one rank, no network: an in-memory store
        dist.init_process_group(backend_for(device), store=dist.HashStore(), rank=0, world_size=1)
    return Group(dist.get_rank(), dist.get_world_size(), local_rank, device, True)


def leave(group: Group) -> None:
    if group.created and dist.is_initialized():
        dist.destroy_process_group()


# The helpers below call the backend even in a one-rank group: a one-rank NCCL run (bench/gpu_check.sh)
# then proves that what they hand it lives on the device.


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def broadcast_int(value: int, device: torch.device, src: int = 0) -> int:
    """Rank `src`'s integer, on every rank (an int64 tensor on the training device)."""
    t = torch.tensor([value], dtype=torch.long, device=device)
    if dist.is_initialized():
        dist.broadcast(t, src)
    return int(t.item())


def all_min_int(value: int, device: torch.device) -> int:
    t = torch.tensor([value], dtype=torch.long, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def all_mean(value: torch.Tensor) -> torch.Tensor:
    """Mean of a scalar across ranks, in fp32 on its own device (every rank gets the same value)."""
    v = value.detach().float().reshape(1).clone()
    if dist.is_initialized():
        dist.all_reduce(v)
        v /= dist.get_world_size()
    return v[0]


def raise_together(error: InputError | None, device: torch.device) -> None:
    """Collective: every rank calls it with its own verdict. If any rank has an error, every rank
    raises: the failing ranks their own, the others a PeerInputError naming the first of them.
    So a bad input stops the whole job at once, with a one-line reason, and no rank is left
    waiting in a collective."""
    rank, world = (dist.get_rank(), _world()) if dist.is_initialized() else (0, 1)
    first = all_min_int(rank if error is not None else world, device)
    if error is not None:
        raise error
    if first < world:
        raise PeerInputError(f"rank {first} rejected the run's input (its error names the file or setting)")


def _fingerprint(path: Path) -> int:
    """A 62-bit digest of a small file's bytes (-1 when it cannot be read)."""
    try:
        return int.from_bytes(hashlib.sha256(path.read_bytes()).digest()[:8], "little") >> 2
    except OSError:
        return -1


def check_shared_storage(data_dir: Path, run_dir: Path, group: Group) -> None:
    """Collective: every rank must see rank 0's data and run directories (shared storage across
    nodes). Rank 0 writes a fresh token into the run directory and hashes the data manifest;
    every rank reads both back. Any rank that cannot stops the job with a one-line error."""
    if group.world == 1:
        return
    run_dir, data_dir = Path(run_dir).resolve(), Path(data_dir).resolve()
    token = run_dir / ".laplace-shared-storage-check"
    nonce = 0
    if group.is_main:
        nonce = secrets.randbits(62)
        run_dir.mkdir(parents=True, exist_ok=True)
        token.write_text(str(nonce))
    nonce = broadcast_int(nonce, group.device)
    manifest = broadcast_int(_fingerprint(data_dir / "manifest.json") if group.is_main else 0, group.device)
    barrier()  # the token is on disk before anyone looks
    problems = []
    try:
        seen = int(token.read_text())
    except (OSError, ValueError):
        seen = None
    if seen != nonce:
        problems.append(f"runs ({run_dir})")
    if _fingerprint(data_dir / "manifest.json") != manifest:
        problems.append(f"data ({data_dir / 'manifest.json'})")
    error = None
    if problems:
        error = InputError(
            f"rank {group.rank} on {socket.gethostname()} cannot see rank 0's {' and '.join(problems)}: "
            "data/ and runs/ must be on storage every node mounts at the same path (docs/training.md)"
        )
    barrier()
    if group.is_main:
        token.unlink(missing_ok=True)
    raise_together(error, group.device)


def owner_reduce_applies(muon_comm: str, precision: str) -> bool:
    """muon.comm owner_reduce leaves the Muon matrices out of FSDP2; with bf16 FSDP2 casts the
    blocks' inputs to bf16, which a plain fp32 matrix cannot multiply: alltoall then."""
    return muon_comm == "owner_reduce" and precision == "fp32"


def shard_model(model: torch.nn.Module, mesh, precision: str, ignored_params: set | None = None) -> None:
    """FSDP2 over `mesh`, by rows, in torchtitan's units: the embedding, each block, the final norm
    with the head, then the root (which then holds no parameters of its own). Tied embeddings
    put the embedding, norm and head in one unit (one parameter, one all-gather). The head's
    unit stays gathered after its forward (its backward follows at once: resharding would only
    gather it again); every other unit is freed after its forward and gathered again for its
    backward. Each unit prefetches the next one's all-gather, forward and backward, so the
    embedding and head are gathered only while they run, not through the whole step.
    bf16: parameters gathered and computed in bf16, gradients reduced in fp32, fp32 master
    weights in the shards; fp32: everything fp32.
    `ignored_params` stay out of FSDP2, whole on every rank: muon.comm owner_reduce's Muon
    matrices (fp32; laplace.training.loop.build_model picks them), whose gradients go to their
    owners by `dist.reduce` and come back updated by `dist.broadcast` (laplace.optim.sharded)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if precision == "bf16"
        else MixedPrecisionPolicy()
    )
    shard = functools.partial(fully_shard, mesh=mesh, mp_policy=policy, ignored_params=ignored_params or None)
    blocks = list(model.blocks)
    if model.cfg.tie_embeddings:  # one parameter: gathered once, kept through forward and backward
        shard([model.embed, model.norm, model.lm_head], reshard_after_forward=False)
        forward, backward = [model.embed, *blocks], blocks[::-1]
    else:
        shard(model.embed)
        shard([model.norm, model.lm_head], reshard_after_forward=False)
        forward, backward = [model.embed, *blocks, model.lm_head], [model.lm_head, *blocks[::-1], model.embed]
    for block in blocks:
        shard(block)
    shard(model)
    # explicit prefetch, as torchtitan sets it: each unit issues the next one's all-gather
    for order, prefetch in (
        (forward, "set_modules_to_forward_prefetch"),
        (backward, "set_modules_to_backward_prefetch"),
    ):
        for unit, following in zip(order, order[1:]):
            getattr(unit, prefetch)([following])


def needs_torchrun(t: TrainSection) -> bool:
    return (t.nproc_per_node > 1 or t.nnodes > 1) and not launched_by_torchrun()


def torchrun_launcher(t: TrainSection) -> list[str]:
    """`torchrun ...` from the train section (standalone unless a rendezvous endpoint is set); the
    module and its arguments follow. The agent is laplace.training.launch: torchrun, tied to its
    parent's life."""
    cmd = [
        sys.executable,
        "-m",
        "laplace.training.launch",
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
