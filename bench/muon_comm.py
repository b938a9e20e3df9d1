"""Benchmark: sharded Muon's two communication strategies side by side, under real torchrun/gloo.

For each world size N (default 2 and 4) one torchrun job times the optimizer step of
the same model with `allgather` (every rank orthogonalises every matrix) and with
`alltoall` (each matrix on its owner rank, two all-to-alls), and meters the bytes each
rank sends and receives. The analytic figures for Laplace 3B at 64 ranks come from the
same layout code. Prints a table and one JSON object.

    .venv/bin/python bench/muon_comm.py [--worlds 2 4] [--steps 5] [--d-model 512 --layers 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def worker(args) -> None:
    """One torchrun rank: time optimizer steps on synthetic gradients for both strategies."""
    from laplace.config import AdamWSection, MuonSection
    from laplace.model.config import preset_model_config
    from laplace.model.lm import LaplaceLM
    from laplace.optim.sharded import ShardedMuonAdamW, traffic_metrics
    from laplace.training import distributed

    group = distributed.join(torch.device("cpu"))
    out = {}
    for comm in ("allgather", "alltoall"):
        torch.manual_seed(0)
        model = LaplaceLM(
            preset_model_config(
                "tiny", vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads
            )
        )
        opt = ShardedMuonAdamW(model, 1e-3, AdamWSection(), MuonSection(), comm=comm)
        gen = torch.Generator().manual_seed(1)
        times = []
        for step in range(args.steps + 1):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen) * 1e-2
            distributed.barrier()
            start = time.perf_counter()
            opt.step()
            distributed.barrier()  # the step is over when the slowest rank is done
            if step:  # the first step allocates buffers
                times.append(time.perf_counter() - start)
            opt.zero_grad()
            if step == 0:
                opt.meter.reset()
        traffic = traffic_metrics(opt.meter.gather(), args.steps)
        out[comm] = {
            "step_seconds": statistics.median(times),
            "muon_bytes_per_rank_max": traffic["muon_bytes_per_rank_per_step_max"],
            "muon_bytes_per_rank_mean": traffic["muon_bytes_per_rank_per_step_mean"],
            "params": sum(p.numel() for p in model.parameters()),
        }
    if group.is_main:
        Path(args.out).write_text(json.dumps(out))
    distributed.leave(group)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    from laplace.model.config import preset_model_config
    from laplace.model.lm import LaplaceLM
    from laplace.optim.sharded import model_traffic

    results = {"machine": f"{torch.get_num_threads()} threads, torch {torch.__version__}", "runs": []}
    for n in args.worlds:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={n}",
                __file__,
                "--worker",
                "--out",
                str(out),
                "--steps",
                str(args.steps),
                "--d-model",
                str(args.d_model),
                "--layers",
                str(args.layers),
                "--heads",
                str(args.heads),
                "--vocab",
                str(args.vocab),
            ]
            subprocess.run(cmd, check=True, capture_output=True)
            r = json.loads(out.read_text())
        results["runs"].append(
            {
                "world_size": n,
                "params": r["alltoall"]["params"],
                "bytes_per_rank_allgather": r["allgather"]["muon_bytes_per_rank_max"],
                "bytes_per_rank_alltoall": r["alltoall"]["muon_bytes_per_rank_max"],
                "bytes_ratio": r["allgather"]["muon_bytes_per_rank_max"] / r["alltoall"]["muon_bytes_per_rank_max"],
                "ideal_ratio": n / 2,
                "step_seconds_allgather": r["allgather"]["step_seconds"],
                "step_seconds_alltoall": r["alltoall"]["step_seconds"],
                "speedup": r["allgather"]["step_seconds"] / r["alltoall"]["step_seconds"],
            }
        )
    with torch.device("meta"):
        big = LaplaceLM(preset_model_config("laplace-3b"))
    results["laplace_3b_at_64_ranks"] = {
        **model_traffic(big, 64),
        "article_allgather_bytes": 10.87e9,
        "article_alltoall_bytes": 0.45e9,
    }
    print(
        f"{'N':>3} {'bytes/rank allgather':>21} {'bytes/rank alltoall':>20} {'ratio':>6} {'ideal':>6} "
        f"{'step s allgather':>17} {'step s alltoall':>16} {'speedup':>8}"
    )
    for r in results["runs"]:
        print(
            f"{r['world_size']:>3} {r['bytes_per_rank_allgather']:>21,.0f} {r['bytes_per_rank_alltoall']:>20,.0f} "
            f"{r['bytes_ratio']:>6.2f} {r['ideal_ratio']:>6.1f} {r['step_seconds_allgather']:>17.3f} "
            f"{r['step_seconds_alltoall']:>16.3f} {r['speedup']:>8.2f}"
        )
    a = results["laplace_3b_at_64_ranks"]
    print(
        f"Laplace 3B, 64 ranks, bf16: allgather {a['allgather_bytes_per_rank_mean'] / 1e9:.2f} GB/rank "
        f"(article 10.87), alltoall {a['alltoall_bytes_per_rank_mean'] / 1e9:.3f} GB/rank mean, "
        f"{a['alltoall_bytes_per_rank_max'] / 1e9:.3f} max (article 0.45)"
    )
    flat = dict(results["runs"][-1])
    flat.update({"runs": results["runs"], "laplace_3b_at_64_ranks": a, "machine": results["machine"]})
    print(json.dumps(flat))


if __name__ == "__main__":
    main()
