"""Benchmark: ShardedMuon's two communication strategies side by side, under real torchrun/gloo.

For each world size N (default 2 and 4) one torchrun job builds the trainer's FSDP2
model (laplace.training.loop.build_model), takes one real forward/backward, then times
the Muon step on those gradients with `allgather` (every rank orthogonalises every
matrix) and with `alltoall` (owner ranks, one equal-split all-to-all each way), and
meters the bytes each rank sends and receives, every rank's, against `laplace plan`'s
prediction for the same model and N (laplace.training.plan, the optimizer's own
ExchangePlan: `bytes_equal_the_plan`, which tests/test_exchange.py checks). The analytic
figures for Laplace 3B at 64 ranks come from the same plan, next to the article's. Then, for
muon.comm owner_reduce and alltoall, it counts the bytes of one whole training step with a
counting hook on every collective (`CollectiveCounter`: each call's own tensors, not the
plan's arithmetic) and compares every rank's figure, by kind (gradients, parameters,
optimizer), with `laplace plan`'s (laplace.training.plan.step_traffic). Prints tables and one
JSON object.

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


class CollectiveCounter:
    """A counting hook on every torch.distributed collective (FSDP2's all-gathers and reduce-
    scatters, DTensor's and our all-reduces, ShardedMuon's all-to-alls, reduces and
    broadcasts): bytes this rank sends and receives, by kind, from each call's own tensors and
    group, not from the plan. The payload rule per call (what a ring or a direct exchange moves):
    all-gather (W-1) x input each way; reduce-scatter (W-1) x output each way; all-to-all the
    input's other ranks' part each way; reduce: the root receives (W-1) x the tensor, the others
    send it once; broadcast the reverse; all-reduce 2 (W-1) / W x the tensor each way."""

    KINDS = {
        "all_gather_single": "parameters",
        "all_gather_into_tensor": "parameters",
        "broadcast": "parameters",
        "reduce_scatter_single": "gradients",
        "reduce_scatter_tensor": "gradients",
        "reduce": "gradients",
        "all_to_all_single": "optimizer",
        "all_reduce": "other",
    }

    def __init__(self):
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        self.counting = False
        self.bytes = {kind: 0 for kind in ("gradients", "parameters", "optimizer", "other")}
        for name, kind in self.KINDS.items():
            original = getattr(c10d, name)
            wrapped = self._wrap(name, kind, original, dist, c10d)
            setattr(c10d, name, wrapped)
            setattr(dist, name, wrapped)

    def _wrap(self, name, kind, original, dist, c10d):
        import inspect

        signature = inspect.signature(original)

        def counted(*args, **kwargs):
            if self.counting:
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                self.bytes[kind] += self._moved(name, list(bound.arguments.values()), bound.arguments, dist)
            return original(*args, **kwargs)

        return counted

    @staticmethod
    def _moved(name, values, named, dist) -> int:
        group = named.get("group")
        world = dist.get_world_size(group)
        nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
        output, inp = values[0], values[1]
        if name.startswith("all_gather"):
            return 2 * (world - 1) * nbytes(inp)
        if name.startswith("reduce_scatter"):
            return 2 * (world - 1) * nbytes(output)
        if name == "all_to_all_single":
            return 2 * nbytes(inp) * (world - 1) // world  # equal splits (ours)
        size = nbytes(values[0])
        if name in ("reduce", "broadcast"):
            root = named.get("dst") if name == "reduce" else named.get("src")
            if root is None:
                root = dist.get_global_rank(group, named.get("group_dst") or named.get("group_src") or 0)
            return (world - 1) * size if dist.get_rank() == root else size
        return 2 * (world - 1) * size // world  # all_reduce


def count_step_bytes(args, group) -> dict:
    """Bytes this rank moves in one whole training step (forward, backward, MuonAdamW's step),
    counted on every collective, for muon.comm owner_reduce and alltoall (fp32)."""
    from torch.distributed.device_mesh import init_device_mesh

    from laplace.config import AdamWSection, MuonSection, TrainSection
    from laplace.model.config import preset_model_config
    from laplace.optim.muon_adamw import MuonAdamW
    from laplace.training.loop import build_model, cross_entropy

    counter = CollectiveCounter()
    mesh = init_device_mesh("cpu", (group.world,))
    cfg = preset_model_config("tiny", vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers, n_heads=4)
    tokens = torch.randint(0, args.vocab, (1, 129), generator=torch.Generator().manual_seed(group.rank))
    out = {}
    for comm in ("owner_reduce", "alltoall"):
        model = build_model(cfg, mesh, group.device, TrainSection(precision="fp32"), seed=0, muon_comm=comm)
        opt = MuonAdamW(model, 1e-3, AdamWSection(), MuonSection(comm=comm))
        for step in range(2):  # the second step is counted: the first initialises FSDP2 and the momentum
            counter.counting = step == 1
            counter.bytes = dict.fromkeys(counter.bytes, 0)
            cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).backward()
            opt.step(max_grad_norm=1.0)
            opt.zero_grad()
        counter.counting = False
        out[comm] = {"comm": opt.muon.comm, **counter.bytes}
    return out


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
    counted = count_step_bytes(args, group)
    everyone = [None] * group.world
    torch.distributed.all_gather_object(everyone, counted)
    out["step_bytes"] = everyone  # every rank's
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
    from laplace.training.plan import ARTICLE, plan, step_traffic

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
        with torch.device("meta"):
            small = LaplaceLM(preset_model_config("tiny", **shape))
        step_plan = step_traffic(small, n, "fp32")
        step_runs = {}
        for comm in ("owner_reduce", "alltoall"):
            for kind in ("gradients", "parameters", "optimizer"):
                measured_kind = [rank[comm][kind] for rank in r["step_bytes"]]
                step_runs.setdefault(comm, {})[kind] = {"measured": measured_kind, "plan": step_plan[comm][kind]}
            total = [sum(rank[comm][k] for k in ("gradients", "parameters", "optimizer")) for rank in r["step_bytes"]]
            step_runs[comm]["total"] = {"measured": total, "plan": step_plan[comm]["total"]}
            step_runs[comm]["other_measured"] = [rank[comm]["other"] for rank in r["step_bytes"]]
            step_runs[comm]["worst_relative_error"] = max(
                abs(m - q) / q for m, q in zip(total, step_plan[comm]["total"]) if q
            )
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
                "step_bytes": step_runs,
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
    print("whole training step, bytes per rank (sent + received), counted on every collective vs the plan:")
    for r in results["runs"]:
        for comm, kinds in r["step_bytes"].items():
            cells = "  ".join(
                f"{k} {max(kinds[k]['measured']):,} ({max(kinds[k]['plan']):,})"
                for k in ("gradients", "parameters", "optimizer")
            )
            print(
                f"  N={r['world_size']} {comm:<12} {cells}  other {max(kinds['other_measured']):,}  "
                f"worst rank off the plan by {kinds['worst_relative_error']:.2%}"
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
