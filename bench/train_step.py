"""Benchmark: training-step throughput, eager vs torch.compile, as a fraction of this machine's peak.

For each preset (default `tiny` and `small`) it builds the model and Muon+AdamW, then
times full training steps (forward, loss, backward, optimizer step), eager and with the
loss compiled (`torch.compile(fullgraph=True, dynamic=False)`: Inductor fuses the
forward and, through AOTAutograd, the backward), and on CUDA the Muon update compiled
(CompiledMuonUpdate, the LR a tensor; AdamW fused), as train.compile does. The optimizer
step is reported apart, as is forward+backward alone. Model FLOPs per
token are counted from the modules (6 x matmul parameters + the GLA core and short
convolutions, forward + backward); MFU = model FLOP/s / the fp32 matmul peak measured
in the same run. Prints a table and one JSON object.

`--distributed` times the trainer's own distributed step instead: for each world size
(`--worlds`, default 1 and 2) a torchrun job builds the FSDP2 model on meta
(laplace.training.loop.build_model) with MuonAdamW, each rank takes its slice of
the same global batch, and full steps (forward, backward, clipping, Muon and AdamW) are
timed. On CPU the ranks share the machine's cores (each gets cores / N threads unless
--threads-per-rank says otherwise); on a GPU each rank has its device (gloo on CPU,
NCCL on CUDA).

    .venv/bin/python bench/train_step.py [--presets tiny small] [--batch 8 --seq-len 256] [--steps 3] [--device cuda]
    .venv/bin/python bench/train_step.py --distributed [--worlds 1 2] [--presets tiny] [--device cuda]
        [--precision bf16] [--compile]
    .venv/bin/python bench/train_step.py --recompute [--presets tiny] [--batch 8 --seq-len 256] [--steps 3]

`--recompute` times train.activation_checkpoint none, full and selective side by side in one
run (the trainer's `apply_activation_checkpointing`, eager, Muon + AdamW), and measures each
mode's peak memory in one more step under torch's MemTracker (torch.distributed._tools: a
dispatch mode that follows every tensor's storage, parameters, gradients, activations and
temporaries apart; outside the timed steps, as it slows them) beside the activations `laplace
plan` predicts for the same micro-batch. Then it prints the plan's table for Laplace 3B at 8,
64 and 128 ranks, 2,048 tokens, bf16, 24 GiB.
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
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from laplace.config import AdamWSection, MuonSection  # noqa: E402
from laplace.model.config import preset_model_config  # noqa: E402
from laplace.model.lm import LaplaceLM  # noqa: E402
from laplace.optim.muon_adamw import MuonAdamW  # noqa: E402

from common import (  # noqa: E402
    add_device_argument,
    emit,
    machine,
    matmul_peak_gflops,
    prepare_device,
    print_table,
    synchronize,
)

VOCAB = {"tiny": 4096, "small": 16384}  # the vocabularies the presets are sized for


def model_flops_per_token(model: LaplaceLM, seq_len: int) -> float:
    """Training FLOPs per token: forward + backward (2x forward) of every matmul, the GLA
    core at the model's chunk size, and the short convolutions. Embedding lookups are free."""
    cfg = model.cfg
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    K, V, H, C = cfg.key_dim, cfg.value_dim, cfg.n_heads, min(cfg.chunk_size, seq_len)
    core = 2 * C * K + 2 * C * V + 4 * K * V / H  # scores, scores @ v, state readout + update
    conv = 2 * cfg.conv_size * (2 * K + V) if cfg.use_short_conv else 0
    return 3 * (2 * linear + cfg.n_layers * (core + conv))


def time_steps(model, optimizer, loss_fn, batches, steps: int, device) -> dict:
    """Full steps after one warm-up step (which also compiles); forward+backward and the
    optimizer step timed apart inside each step."""
    fwd_bwd, opt, total = [], [], []
    first = None
    for i, (x, y) in enumerate(batches[: steps + 1]):
        synchronize(device)
        start = time.perf_counter()
        loss = loss_fn(x, y)
        loss.backward()
        synchronize(device)
        mid = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        synchronize(device)
        end = time.perf_counter()
        if i == 0:
            first = end - start
            continue
        fwd_bwd.append(mid - start)
        opt.append(end - mid)
        total.append(end - start)
    return {
        "first_step_s": first,
        "step_s": statistics.median(total),
        "fwd_bwd_s": statistics.median(fwd_bwd),
        "optimizer_s": statistics.median(opt),
        "final_loss": float(loss.detach()),
    }


def bench_preset(preset: str, batch: int, seq_len: int, steps: int, peak: float, device) -> dict:
    cfg = preset_model_config(preset, vocab_size=VOCAB.get(preset, 16384))
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), generator=gen) for _ in range(steps + 1)]
    batches = [(b[:, :-1].to(device), b[:, 1:].to(device)) for b in batches]
    out = {}
    for mode in ("eager", "compiled"):
        torch.manual_seed(0)
        model = LaplaceLM(cfg).to(device)
        # compiled: the loss, and on CUDA the Muon update too (CompiledMuonUpdate; AdamW fused), as training does
        backend = "inductor" if mode == "compiled" and device.type == "cuda" else None
        optimizer = MuonAdamW(model, 1e-3, AdamWSection(), MuonSection(), compile_backend=backend)

        def loss_fn(x, y, model=model):
            logits = model(x)
            return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

        if mode == "compiled":
            torch._dynamo.reset()
            loss_fn = torch.compile(loss_fn, fullgraph=True, dynamic=False)
        out[mode] = time_steps(model, optimizer, loss_fn, batches, steps, device)
    tokens = batch * seq_len
    flops = model_flops_per_token(model, seq_len)
    result = {
        "params": sum(p.numel() for p in model.parameters()),
        "batch": batch,
        "seq_len": seq_len,
        "tokens_per_step": tokens,
        "model_flops_per_token": flops,
        "compile_s": out["compiled"]["first_step_s"] - out["eager"]["first_step_s"],
        "eager": out["eager"],
        "compiled": out["compiled"],
    }
    for mode in ("eager", "compiled"):
        r = out[mode]
        result[f"tokens_per_s_{mode}"] = tokens / r["step_s"]
        result[f"tokens_per_s_fwd_bwd_{mode}"] = tokens / r["fwd_bwd_s"]
        result[f"mfu_{mode}"] = flops * tokens / r["step_s"] / 1e9 / peak
        result[f"mfu_fwd_bwd_{mode}"] = flops * tokens / r["fwd_bwd_s"] / 1e9 / peak
    result["compiled_speedup"] = out["eager"]["step_s"] / out["compiled"]["step_s"]
    result["compiled_speedup_fwd_bwd"] = out["eager"]["fwd_bwd_s"] / out["compiled"]["fwd_bwd_s"]
    # What any compiler that leaves the matmuls to the same BLAS could at best reach:
    # the eager forward+backward over the time its matmul FLOPs take at the measured peak.
    result["fwd_bwd_speedup_ceiling"] = out["eager"]["fwd_bwd_s"] / (flops * tokens / peak / 1e9)
    return result


def distributed_worker(args) -> None:
    """One torchrun rank of `--distributed`: the trainer's FSDP2 model and optimizer, timed."""
    from torch.distributed.device_mesh import init_device_mesh

    from laplace.config import TrainSection
    from laplace.optim.muon_adamw import MuonAdamW
    from laplace.runtime import compile_backend
    from laplace.training import distributed
    from laplace.training.loop import build_model, cross_entropy

    world = int(os.environ["WORLD_SIZE"])
    device, _ = prepare_device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads_per_rank or max(1, (os.cpu_count() or 1) // world))
    group = distributed.join(device)
    mesh = init_device_mesh(group.device.type, (group.world,))
    cfg = preset_model_config(args.presets[0], vocab_size=VOCAB.get(args.presets[0], 16384))
    t = TrainSection(precision=args.precision, compile=args.compile)
    model = build_model(cfg, mesh, group.device, t, seed=0)  # compiled per block with --compile
    backend = compile_backend(group.device) if args.compile else None
    optimizer = MuonAdamW(model, 1e-3, AdamWSection(), MuonSection(comm=args.comm), compile_backend=backend)
    flops = model_flops_per_token(model, args.seq_len)  # reads shapes and cfg only: fine on shards
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    peak = matmul_peak_gflops(dtype=dtype, device=group.device)
    gen = torch.Generator().manual_seed(0)
    per_rank = args.batch // group.world
    steps, fwd_bwd, opt = [], [], []
    for i in range(args.steps + 1):
        tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1), generator=gen)
        mine = tokens[group.rank * per_rank : (group.rank + 1) * per_rank].to(group.device)
        distributed.barrier()
        synchronize(group.device)
        start = time.perf_counter()
        cross_entropy(model(mine[:, :-1]), mine[:, 1:]).backward()
        synchronize(group.device)
        mid = time.perf_counter()
        optimizer.step(max_grad_norm=1.0)
        optimizer.zero_grad()
        synchronize(group.device)
        distributed.barrier()
        end = time.perf_counter()
        if i:  # the first step allocates the optimizer state (and compiles)
            steps.append(end - start)
            fwd_bwd.append(mid - start)
            opt.append(end - mid)
    if group.is_main:
        step = statistics.median(steps)
        result = {
            "world_size": group.world,
            "params": model.num_parameters(),
            "step_s": step,
            "fwd_bwd_s": statistics.median(fwd_bwd),
            "optimizer_s": statistics.median(opt),
            "tokens_per_s": args.batch * args.seq_len / step,
            "compiled": args.compile,
            "precision": args.precision,
            "matmul_peak_gflops": peak,  # of the precision's dtype, per rank
            "mfu": flops * args.batch * args.seq_len / step / 1e9 / (peak * group.world),
            "threads_per_rank": torch.get_num_threads() if group.device.type == "cpu" else None,
        }
        Path(args.out).write_text(json.dumps(result))
    distributed.leave(group)


def distributed_main(args) -> None:
    device, _ = prepare_device(args.device)
    rows, runs = [], []
    for n in args.worlds:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            # --no-python: each rank runs this script with the same interpreter
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={n}",
                "--no-python",
            ]
            cmd += [sys.executable, __file__]
            cmd += ["--distributed-worker", "--out", str(out), "--presets", args.presets[0], "--device", args.device]
            cmd += ["--batch", str(args.batch), "--seq-len", str(args.seq_len), "--steps", str(args.steps)]
            cmd += ["--precision", args.precision, "--comm", args.comm]
            cmd += ["--threads-per-rank", str(args.threads_per_rank)] + (["--compile"] if args.compile else [])
            subprocess.run(cmd, check=True, capture_output=True)
            r = json.loads(out.read_text())
        runs.append(r)
        rows.append([n, r["params"], r["tokens_per_s"], r["mfu"], r["step_s"], r["fwd_bwd_s"], r["optimizer_s"]])
    print(
        f"{device}: distributed training step, FSDP2 + MuonAdamW ({args.comm}, {args.precision}), "
        f"`{args.presets[0]}`, global batch {args.batch} x {args.seq_len}"
    )
    print_table(["ranks", "params", "tok/s", "MFU", "step s", "fwd+bwd s", "optimizer s"], rows)
    emit({"machine": machine(device), "preset": args.presets[0], "comm": args.comm, "runs": runs})


def recompute_main(args) -> None:
    from torch.distributed._tools.mem_tracker import MemTracker

    from laplace.training.activation_checkpoint import MODES, apply_activation_checkpointing
    from laplace.training.activations import activation_bytes
    from laplace.training.plan import GIB, plan

    device, _ = prepare_device(args.device)
    preset = args.presets[0]
    cfg = preset_model_config(preset, vocab_size=VOCAB.get(preset, 16384))
    gen = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1), generator=gen) for _ in range(args.steps + 2)
    ]
    batches = [(b[:, :-1].to(device), b[:, 1:].to(device)) for b in batches]
    predicted = activation_bytes(cfg, args.batch, args.seq_len, torch.float32)
    rows, runs = [], {}
    for mode in MODES:
        torch.manual_seed(0)
        model = LaplaceLM(cfg).to(device)
        apply_activation_checkpointing(model, mode)
        optimizer = MuonAdamW(model, 1e-3, AdamWSection(), MuonSection())

        def loss_fn(x, y, model=model):
            return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())

        timed = time_steps(model, optimizer, loss_fn, batches[:-1], args.steps, device)
        tracker = MemTracker()
        tracker.track_external(model, optimizer.muon, optimizer.adamw)
        with tracker:
            loss_fn(*batches[-1]).backward()
        peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
        kinds = {str(k).split(".")[-1].lower(): v for k, v in peak.items()}
        runs[mode] = {**timed, "tokens_per_s": args.batch * args.seq_len / timed["step_s"], "peak_bytes": kinds}
        rows.append(
            [
                mode,
                runs[mode]["tokens_per_s"],
                timed["fwd_bwd_s"],
                kinds["total"] / 2**20,
                kinds["act"] / 2**20,
                predicted["peak_bytes"][mode] / 2**20,
                timed["final_loss"],
            ]
        )
    print(f"{device}: activation checkpointing, `{preset}`, batch {args.batch} x {args.seq_len}, fp32 eager")
    print_table(["mode", "tok/s", "fwd+bwd s", "peak MiB", "activations MiB", "plan's activations MiB", "loss"], rows)
    tables = {}
    for world in (8, 64, 128):
        p = plan(preset_model_config("laplace-3b"), world, "bf16", 24.0, seq_len=2048, micro_batch=1)
        tables[world] = p
    print("\nlaplace plan: Laplace 3B, bf16, micro-batch 1 x 2048 tokens, 24 GiB per rank (max over ranks)")
    plan_rows = []
    for world, p in tables.items():
        m = p["modes"]
        plan_rows.append(
            [
                world,
                p["per_rank_total_max_bytes"] / GIB,
                *(m[k]["total_bytes"] / GIB for k in MODES),
                *(m[k]["max_micro_batch"] for k in MODES),
                p["needs_activation_checkpoint"],
            ]
        )
    print_table(
        [
            "ranks",
            "static GiB",
            "none GiB",
            "full GiB",
            "selective GiB",
            "max mb none",
            "max mb full",
            "max mb sel",
            "needs",
        ],
        plan_rows,
    )
    emit(
        {
            "machine": machine(device),
            "preset": preset,
            "batch": args.batch,
            "seq_len": args.seq_len,
            "runs": runs,
            "plan_activation_bytes": predicted["peak_bytes"],
            "plan_3b": {w: {"static": p["per_rank_total_max_bytes"], "modes": p["modes"]} for w, p in tables.items()},
        }
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["tiny", "small"])
    ap.add_argument("--batch", type=int, default=8, help="params.yaml's train.batch_size")
    ap.add_argument("--seq-len", type=int, default=256, help="params.yaml's train.seq_len")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--distributed", action="store_true", help="time the FSDP2 step under torchrun instead")
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2], help="--distributed: ranks per run")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="--distributed only")
    ap.add_argument("--comm", choices=["alltoall", "allgather"], default="alltoall", help="--distributed only")
    ap.add_argument(
        "--threads-per-rank", type=int, default=0, help="--distributed on CPU: torch threads per rank (0: cores / N)"
    )
    ap.add_argument(
        "--compile", action="store_true", help="--distributed only: per-block compile and the compiled Muon update"
    )
    ap.add_argument(
        "--recompute", action="store_true", help="activation checkpointing none/full/selective side by side"
    )
    ap.add_argument("--distributed-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    add_device_argument(ap)
    args = ap.parse_args(argv)
    if args.distributed_worker:
        distributed_worker(args)
        return
    if args.recompute:
        if "--presets" not in (argv or sys.argv):
            args.presets = ["tiny"]
        recompute_main(args)
        return
    if args.distributed:
        if "--presets" not in (argv or sys.argv):
            args.presets = ["tiny"]
        distributed_main(args)
        return
    device, kept = prepare_device(args.device)
    peak = matmul_peak_gflops(device=device)
    result = {"machine": machine(device), "matmul_peak_gflops": peak, "kept_cpu_allocations": kept, "presets": {}}
    rows = []
    for preset in args.presets:
        r = bench_preset(preset, args.batch, args.seq_len, args.steps, peak, device)
        result["presets"][preset] = r
        rows.append(
            [
                preset,
                r["params"],
                r["tokens_per_s_eager"],
                r["tokens_per_s_compiled"],
                r["compiled_speedup"],
                r["compiled_speedup_fwd_bwd"],
                r["fwd_bwd_speedup_ceiling"],
                r["mfu_eager"],
                r["mfu_compiled"],
                r["mfu_fwd_bwd_compiled"],
                r["compiled"]["optimizer_s"],
                r["compile_s"],
            ]
        )
    # the keys the issue names, for the `small` preset when it ran (else the last one)
    main_preset = result["presets"].get("small") or r
    for key in ("tokens_per_s_eager", "tokens_per_s_compiled", "mfu_compiled", "mfu_eager", "compiled_speedup"):
        result[key] = main_preset[key]
    print(f"{device}: fp32 matmul peak {peak:.1f} GFLOP/s; batch {args.batch} x {args.seq_len} tokens")
    print_table(
        [
            "preset",
            "params",
            "tok/s eager",
            "tok/s compiled",
            "speedup",
            "fwd+bwd speedup",
            "ceiling",
            "MFU eager",
            "MFU compiled",
            "MFU fwd+bwd",
            "optimizer s",
            "compile s",
        ],
        rows,
    )
    emit(result)


if __name__ == "__main__":
    main()
