"""Run by torchrun from test_sharded.py: a few sharded Muon+AdamW steps on data identical on every
rank, for both communication strategies; rank 0 saves the final parameters and the traffic."""

import json
import sys

import torch
from safetensors.torch import save_file

from laplace.config import AdamWSection, MuonSection
from laplace.model.config import preset_model_config
from laplace.model.lm import LaplaceLM
from laplace.optim.sharded import ShardedMuonAdamW
from laplace.training import distributed
from laplace.training.loop import cross_entropy

STEPS, VOCAB = 4, 300


def small_model() -> LaplaceLM:
    torch.manual_seed(0)
    return LaplaceLM(
        preset_model_config(
            "tiny", vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=2, chunk_size=16, sub_chunk_size=8
        )
    )


def batch(step: int):
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (2, 33), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def main(out_prefix: str) -> None:
    torch.set_num_threads(1)
    group = distributed.join(torch.device("cpu"))
    results = {}
    for comm in ("alltoall", "allgather"):
        model = small_model()
        opt = ShardedMuonAdamW(model, 3e-3, AdamWSection(), MuonSection(), comm=comm)
        opt.set_lr_scale(1.0)
        for step in range(STEPS):
            x, y = batch(step)  # the same data on every rank
            cross_entropy(model(x), y).backward()
            opt.step(max_grad_norm=0.0)
            opt.zero_grad()
        traffic = opt.meter.gather()
        if group.is_main:
            save_file(
                {k: v.detach().contiguous() for k, v in model.state_dict().items()}, f"{out_prefix}-{comm}.safetensors"
            )
            results[comm] = traffic
    if group.is_main:
        with open(f"{out_prefix}-traffic.json", "w") as f:
            json.dump(results, f)
    distributed.leave(group)


if __name__ == "__main__":
    main(sys.argv[1])
