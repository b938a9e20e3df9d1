"""Run by torchrun from tests/test_checkpoint.py, on gloo: checkpoints of a tiny FSDP2 model.

    checkpoint_worker.py ROOT OUT

Rank 0 writes OUT (JSON): what each rank chose to resume from, in three situations."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from laplace.config import AdamWSection, MuonSection, TrainSection
from laplace.model.config import preset_model_config
from laplace.optim.muon_adamw import MuonAdamW
from laplace.training import checkpoint as ckpt
from laplace.training import distributed, lifecycle
from laplace.training.loop import build_model, cross_entropy


def chosen_everywhere(root: Path, device) -> list[int]:
    """The step every rank's latest_verified picks, gathered (-1: none)."""
    found = ckpt.latest_verified(root, device)
    mine = torch.tensor([int(found.name.split("_")[1]) if found else -1])
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [int(t) for t in every]


def main(root: str, out: str) -> None:
    lifecycle.die_with_agent()  # a timed-out test kills the agent: the ranks go with it
    torch.set_num_threads(1)
    root = Path(root)
    group = distributed.join(torch.device("cpu"))
    mesh = init_device_mesh("cpu", (group.world,))
    cfg = preset_model_config("tiny", vocab_size=64, d_model=32, n_layers=1, n_heads=2)
    model = build_model(cfg, mesh, group.device, TrainSection(), seed=0)
    opt = MuonAdamW(model, 1e-3, AdamWSection(), MuonSection())
    tokens = torch.randint(0, 64, (group.world, 17), generator=torch.Generator().manual_seed(0))[
        group.rank : group.rank + 1
    ]
    cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    opt.step()
    report: dict = {}

    sync = ckpt.Checkpointer(root, keep=5, device=group.device)
    for step in (2, 4):
        sync.save(step, model, opt.optimizers, {"history": []})
    # async: the state is staged when save returns, so changing the weights right after changes
    # nothing in the checkpoint; it is in place (renamed) only after close
    saver = ckpt.Checkpointer(root, keep=5, device=group.device, asynchronous=True)
    expected = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    final = saver.save(6, model, opt.optimizers, {"history": []})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    report["async_in_place_before_close"] = final.exists()
    dist.barrier()
    saver.close()
    report["async_in_place_after_close"] = final.exists()
    report["async_staging_left"] = sorted(p.name for p in root.glob(".step_*"))
    stored = ckpt.model_tensors(final)
    report["async_weights_as_at_save"] = all(torch.equal(stored[k], expected[k]) for k in expected)
    report["manifest_files"] = sorted(json.loads((final / "manifest.json").read_text())["files"])

    # 1. rank 1's listing of the shared directory holds an extra, newer directory: the step is rank 0's
    real = ckpt.list_checkpoints
    if group.rank == 1:
        stale = root / "step_000009"  # another node's view: only this rank lists it
        ckpt.list_checkpoints = lambda r: [(9, stale), *real(r)]
    report["stale_listing"] = chosen_everywhere(root, group.device)
    ckpt.list_checkpoints = real

    # 2. a shard that only rank 1 verifies (every world-th file) is damaged: every rank falls back
    if group.rank == 0:
        shard = final / report["manifest_files"][1]
        data = bytearray(shard.read_bytes())
        data[-1] ^= 0xFF
        shard.write_bytes(bytes(data))
    dist.barrier()
    report["damaged_newest"] = chosen_everywhere(root, group.device)
    if group.rank == 0:
        Path(out).write_text(json.dumps(report))
    distributed.leave(group)


if __name__ == "__main__":
    main(*sys.argv[1:])
