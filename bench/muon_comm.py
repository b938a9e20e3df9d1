"""Benchmark: ShardedMuon's two communication strategies side by side, under real torchrun/gloo.

For each world size N (default 2 and 4) one torchrun job builds the trainer's FSDP2
model (laplace.training.loop.build_model), takes one real forward/backward, then times
the Muon step on those gradients with `allgather` (every rank orthogonalises every
matrix) and with `alltoall` (owner ranks, one equal-split all-to-all each way), and
meters the bytes each rank sends and receives, every rank's, against `laplace plan`'s
prediction for the same model and N (laplace.training.plan, the optimizer's own
ExchangePlan: `bytes_equal_the_plan`, which tests/test_exchange.py checks). The analytic
figures for Laplace 3B at 64 ranks come from the same plan, next to the article's. Prints a
table and one JSON object.

    .venv/bin/python bench/muon_comm.py [--worlds 2 4] [--steps 5] [--d-model 512 --layers 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def worker(args) -> None:
    """One torchrun rank: time Muon steps of both strategies on the same gradients."""
    from torch.distributed.device_mesh import init_device_mesh

    from laplace.config import AdamWSection, MuonSection, TrainSection
    from laplace.model.config import preset_model_config
    from laplace.optim.exchange import traffic_metrics
    from laplace.optim.muon_adamw import MuonAdamW
    from laplace.training import distributed
    from laplace.training.loop import build_model, cross_entropy

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["WORLD_SIZE"])))
    group = distributed.join(torch.device("cpu"))
    mesh = init_device_mesh("cpu", (group.world,))
    cfg = preset_model_config("tiny", vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers, n_heads=4)
    model = build_model(cfg, mesh, group.device, TrainSection(), seed=0)
    tokens = torch.randint(0, args.vocab, (1, 129), generator=torch.Generator().manual_seed(group.rank))
    cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    out = {}
    for comm in ("allgather", "alltoall"):
        opt = MuonAdamW(model, 1e-3, AdamWSection(), MuonSection(comm=comm))
        times = []
        for step in range(args.steps + 1):
            distributed.barrier()
            start = time.perf_counter()
            opt.muon.step()
            distributed.barrier()  # the step is over when the slowest rank is done
            if step:  # the first step allocates the momentum
                times.append(time.perf_counter() - start)
            else:
                opt.meter.reset()
        gathered = opt.meter.gather(device=group.device)
        traffic = traffic_metrics(gathered, args.steps)
        every_rank = [sum(v["sent"][r] + v["received"][r] for v in gathered.values()) for r in range(group.world)]
        out[comm] = {
            "step_seconds": statistics.median(times),
            "muon_bytes_per_rank_max": traffic["muon_bytes_per_rank_per_step_max"],
            "muon_bytes_per_rank_mean": traffic["muon_bytes_per_rank_per_step_mean"],
            "muon_bytes_per_rank_min": min(every_rank) / args.steps,
            "params": model.num_parameters(),
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
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    from laplace.model.config import preset_model_config
    from laplace.model.lm import LaplaceLM
    from laplace.optim.exchange import model_traffic
    from laplace.training.plan import ARTICLE, plan

    shape = dict(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers, n_heads=4)
    results = {"machine": f"{os.cpu_count()} cores, torch {torch.__version__}", "runs": []}
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
                "--vocab",
                str(args.vocab),
            ]
            subprocess.run(cmd, check=True, capture_output=True)
            r = json.loads(out.read_text())
        predicted = plan(preset_model_config("tiny", **shape), n, precision="fp32")["muon_traffic"]
        ag, a2a = r["allgather"]["muon_bytes_per_rank_max"], r["alltoall"]["muon_bytes_per_rank_max"]
        # every rank's measured bytes (min, mean and max over the ranks) against the plan's
        measured = [r[c][f"muon_bytes_per_rank_{k}"] for c in ("allgather", "alltoall") for k in ("min", "mean", "max")]
        expected = [predicted["allgather_bytes_per_rank"]] * 3 + [predicted["alltoall_bytes_per_rank"]] * 3
        results["runs"].append(
            {
                "world_size": n,
                "params": r["alltoall"]["params"],
                "bytes_per_rank_allgather": ag,
                "bytes_per_rank_alltoall": a2a,
                "plan_bytes_per_rank_allgather": predicted["allgather_bytes_per_rank"],
                "plan_bytes_per_rank_alltoall": predicted["alltoall_bytes_per_rank"],
                "bytes_equal_the_plan": measured == expected,
                "plan_newton_schulz_work_max_over_mean": predicted["newton_schulz_work_max_over_mean"],
                "bytes_ratio": ag / a2a,
                "ideal_ratio": n / 2,
                "step_seconds_allgather": r["allgather"]["step_seconds"],
                "step_seconds_alltoall": r["alltoall"]["step_seconds"],
                "speedup": r["allgather"]["step_seconds"] / r["alltoall"]["step_seconds"],
            }
        )
    with torch.device("meta"):
        big = LaplaceLM(preset_model_config("laplace-3b"))
    a = {
        **model_traffic(big, ARTICLE["world_size"]),
        "article_allgather_bytes": ARTICLE["allgather_bytes"],
        "article_alltoall_bytes": ARTICLE["alltoall_bytes"],
    }
    results["laplace_3b_at_64_ranks"] = a
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
    print(
        f"Laplace 3B, 64 ranks, bf16: allgather {a['allgather_bytes_per_rank'] / 1e9:.2f} GB/rank (article 10.87), "
        f"alltoall {a['alltoall_bytes_per_rank'] / 1e9:.3f} GB/rank (article 0.45), "
        f"of which padding {(a['alltoall_bytes_per_rank'] - a['alltoall_unpadded_bytes_per_rank']) / 1e9:.3f}"
    )
    flat = dict(results["runs"][-1])
    flat.update({"runs": results["runs"], "laplace_3b_at_64_ranks": a, "machine": results["machine"]})
    print(json.dumps(flat))


if __name__ == "__main__":
    main()
