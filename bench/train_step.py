"""Benchmark: training-step throughput, eager vs torch.compile, as a fraction of this machine's peak.

For each preset (default `tiny` and `small`) it builds the model and Muon+AdamW, then
times full training steps (forward, loss, backward, optimizer step), eager and with the
loss compiled (`torch.compile(fullgraph=True, dynamic=False)`: Inductor fuses the
forward and, through AOTAutograd, the backward). The optimizer step is the same eager
code in both; its time is reported apart, as is forward+backward alone. Model FLOPs per
token are counted from the modules (6 x matmul parameters + the GLA core and short
convolutions, forward + backward); MFU = model FLOP/s / the fp32 matmul peak measured
in the same run. Prints a table and one JSON object.

    .venv/bin/python bench/train_step.py [--presets tiny small] [--batch 8 --seq-len 256] [--steps 3] [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from laplace.config import AdamWSection, MuonSection  # noqa: E402
from laplace.model.config import preset_model_config  # noqa: E402
from laplace.model.lm import LaplaceLM  # noqa: E402
from laplace.optim.muon import MuonAdamW  # noqa: E402

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
        optimizer = MuonAdamW(model, 1e-3, AdamWSection(), MuonSection())

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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["tiny", "small"])
    ap.add_argument("--batch", type=int, default=8, help="params.yaml's train.batch_size")
    ap.add_argument("--seq-len", type=int, default=256, help="params.yaml's train.seq_len")
    ap.add_argument("--steps", type=int, default=3)
    add_device_argument(ap)
    args = ap.parse_args(argv)
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
