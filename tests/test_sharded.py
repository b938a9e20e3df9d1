"""Sharded Muon under real torchrun/gloo processes: bit-for-bit equal to single-process Muon for
world sizes 1-4 and both strategies, traffic as the formulas say, loss curves that match across
world sizes, and resume at the same and at a different world size."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from laplace.config import AdamWSection, MuonSection, config_from_dict
from laplace.optim.muon import MuonAdamW
from laplace.optim.sharded import FlatLayout, assign_owners, muon_traffic
from laplace.pipeline.layout import Paths
from laplace.pipeline.stage_train import run_training
from laplace.training import checkpoint as ckpt
from laplace.training.loop import cross_entropy

from sharded_worker import STEPS, batch, small_model

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent


def torchrun(n: int, args: list[str], cwd: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", *args]
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


@pytest.fixture(scope="module")
def reference():
    """Single-process Muon (bit-identical to torch.optim.Muon, tests/test_muon.py) + AdamW."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the torchrun ranks run single-threaded; so does the reference
    try:
        model = small_model()
        opt = MuonAdamW(model, 3e-3, AdamWSection(), MuonSection())
        opt.set_lr_scale(1.0)
        for step in range(STEPS):
            x, y = batch(step)
            cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    finally:
        torch.set_num_threads(threads)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sharded_muon_equals_single_process_bit_for_bit(world, reference, tmp_path):
    prefix = tmp_path / f"w{world}"
    torchrun(world, [str(HERE / "sharded_worker.py"), str(prefix)], cwd=HERE)
    for comm in ("alltoall", "allgather"):
        got = load_file(f"{prefix}-{comm}.safetensors")
        assert got.keys() == reference.keys()
        for k in reference:
            assert torch.equal(got[k], reference[k]), (world, comm, k, (got[k] - reference[k]).abs().max())
    traffic = json.loads(Path(f"{prefix}-traffic.json").read_text())
    model = small_model()
    from laplace.optim.sharded import model_traffic

    expected = model_traffic(model, world)
    for comm, key in (("alltoall", "alltoall_bytes_per_rank_max"), ("allgather", "allgather_bytes_per_rank_max")):
        muon = [
            sum(
                traffic[comm][c]["sent"][r] + traffic[comm][c]["received"][r]
                for c in traffic[comm]
                if c.startswith("muon_")
            )
            / STEPS
            for r in range(world)
        ]
        assert max(muon) == expected[key]  # the meter and the formula count the same bytes
    if world > 1:
        ag = sum(traffic["allgather"]["muon_allgather"]["sent"]) + sum(
            traffic["allgather"]["muon_allgather"]["received"]
        )
        a2a = sum(
            traffic["alltoall"][c][d][r]
            for c in ("muon_to_owner", "muon_from_owner")
            for d in ("sent", "received")
            for r in range(world)
        )
        assert ag / a2a >= 0.9 * world / 2  # the target: close to the ideal N/2


def test_layout_and_owners():
    layout = FlatLayout([10, 7, 5], world=3)  # total 22, chunk 8
    assert [layout.shard_range(r) for r in range(3)] == [(0, 8), (8, 16), (16, 22)]
    assert [(s.index, s.param_lo, s.param_hi) for s in layout.slices[1]] == [(0, 8, 10), (1, 0, 6)]
    assert sum(s.size for r in range(3) for s in layout.slices[r]) == 22
    # largest Newton-Schulz cost first, each to the least-loaded rank
    assert assign_owners([(64, 64), (64, 64), (8, 8), (128, 64)], world=2, ns_steps=5) == [1, 1, 0, 0]
    # 5 ranks, 2 matrices of 16 values cut unevenly (7, 7, 2 | 5, 7, 4): ranks 2-4 own nothing.
    # all-to-all: rank 1 sends 7 values to rank 0 and receives 5 + 7 + 4, both ways, bf16: 2*(7+16)*2 = 92 B;
    # all-gather: ranks 0-3 send their 7 values to 4 others and receive the other 25: (28+25)*2 = 106 B
    uneven = muon_traffic(["muon", "muon", "adamw_decay"], [(4, 4), (4, 4), (3,)], world=5)
    assert uneven["alltoall_bytes_per_rank_max"] == 92
    assert uneven["allgather_bytes_per_rank_max"] == 106


def run_cfg(world: int, steps: int = 8) -> object:
    return config_from_dict(
        {
            "data": {"max_documents": 300, "num_proc": 1},
            "tokenizer": {"vocab_size": 400},
            "model": {
                "preset": "tiny",
                "d_model": 32,
                "n_layers": 2,
                "n_heads": 2,
                "chunk_size": 16,
                "sub_chunk_size": 8,
            },
            "train": {
                "steps": steps,
                "batch_size": 4,
                "seq_len": 32,
                "log_every": 1,
                "eval_every": steps,
                "eval_batches": 1,
                "checkpoint_every": 100,
                "warmup_steps": 2,
                "nproc_per_node": world,
            },
        }
    )


def project(tmp_path: Path, data_dir: Path) -> Paths:
    paths = Paths.at(tmp_path)
    paths.data_dir.parent.mkdir(parents=True, exist_ok=True)
    paths.data_dir.symlink_to(data_dir)
    return paths


def test_loss_curves_agree_across_world_sizes(tiny_artifacts, tmp_path):
    data_dir, _ = tiny_artifacts
    one, hist1, _ = run_training(run_cfg(1), project(tmp_path / "one", data_dir))
    two, hist2, _ = run_training(run_cfg(2), project(tmp_path / "two", data_dir))
    assert two["world_size"] == 2 and one["world_size"] == 1
    l1 = [h["loss"] for h in hist1 if "loss" in h]
    l2 = [h["loss"] for h in hist2 if "loss" in h]
    assert len(l1) == len(l2) == 8
    assert max(abs(a - b) / a for a, b in zip(l1, l2)) <= 1e-5
    assert two["traffic"]["muon_bytes_per_rank_per_step_max"] > 0


def test_resume_at_the_same_and_at_a_different_world_size(tiny_artifacts, tmp_path):
    data_dir, _ = tiny_artifacts
    full, hist_full, ckpt_full = run_training(run_cfg(2), project(tmp_path / "full", data_dir))
    split = project(tmp_path / "split", data_dir)
    run_training(run_cfg(2), split, stop_at_step=4)
    resumed, _, ckpt_resumed = run_training(run_cfg(2), split)
    assert resumed["resumed_from_step"] == 4
    a, b = ckpt.model_tensors(ckpt_full), ckpt.model_tensors(ckpt_resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)  # same world size: bit for bit

    other = project(tmp_path / "other", data_dir)
    run_training(run_cfg(2), other, stop_at_step=4)
    wider, hist_wider, ckpt_wider = run_training(run_cfg(4), other)
    assert wider["resumed_from_step"] == 4 and wider["world_size"] == 4
    assert json.loads((ckpt_wider / "trainer.json").read_text())["world_size"] == 4
    losses_full = {h["step"]: h["loss"] for h in hist_full if "loss" in h}
    losses_wider = {h["step"]: h["loss"] for h in hist_wider if "loss" in h}
    # the same optimisation continues: the steps before the resume are identical, after it the
    # 4-way data split only changes rounding
    assert all(losses_wider[s] == losses_full[s] for s in range(1, 5))
    assert all(math.isclose(losses_wider[s], losses_full[s], rel_tol=1e-4) for s in range(5, 9))
