"""Benchmark: one GLA layer's token mixing, forward + backward, against causal softmax attention.

At each sequence length (batch 1, fp32, the `small` preset's width: 6 heads, key dim
384, value dim 768) it times, side by side in one run:
  - our chunked form (`chunk_gla`) at chunk 32, 64 and 128,
  - our token-by-token recurrent form (`gla_step` in a loop),
  - `scaled_dot_product_attention(is_causal=True)` with the same 768-wide q, k, v,
and reports each form's achieved GFLOP/s against this machine's fp32 matmul peak,
measured in the same run. Prints a table and one JSON object.

    .venv/bin/python bench/gla_scaling.py [--lengths 512 1024 2048 4096 8192] [--repeats 5] [--device cuda]
        [--kernel fla] [--recurrent-repeats 0]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from laplace.model.config import preset_model_config  # noqa: E402
from laplace.model.gla import chunk_gla, gla_step  # noqa: E402

from common import (  # noqa: E402
    add_device_argument,
    emit,
    machine,
    matmul_peak_gflops,
    median_seconds,
    prepare_device,
    print_table,
)

CHUNKS = (32, 64, 128)


def gla_inputs(T: int, H: int, K: int, V: int, seed: int = 0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, H, K, generator=gen)
    k = torch.randn(1, T, H, K, generator=gen)
    v = torch.randn(1, T, H, V, generator=gen)
    g = F.logsigmoid(torch.randn(1, T, H, K, generator=gen)) / 16  # the model's gate
    return [x.to(device).requires_grad_() for x in (q, k, v, g)]


def chunked(inputs, chunk: int, sub: int, compiled: bool = False):
    def forward(q, k, v, g):
        return chunk_gla(q, k, v, g, chunk_size=chunk, sub_chunk_size=sub)[0].sum()

    if compiled:  # what Inductor makes of the same code (the training step compiles it this way)
        forward = torch.compile(forward, fullgraph=True, dynamic=False)

    def run():
        forward(*inputs).backward()

    return run


def fla_chunked(inputs, cfg):
    """The same forward+backward through model.kernel: fla (flash-linear-attention's Triton chunk
    kernel as the model's custom op; CUDA only)."""
    from laplace.model import kernels

    def run():
        o, _ = kernels.chunk(
            "fla",
            *inputs,
            initial_state=None,
            lengths=None,
            chunk_size=cfg.chunk_size,
            sub_chunk_size=cfg.sub_chunk_size,
            segment_len=cfg.segment_len,
        )
        o.sum().backward()

    return run


def recurrent(inputs):
    q, k, v, g = inputs

    def run():
        B, T, H, K = q.shape
        S = q.new_zeros(B, H, K, v.shape[-1])
        outs = []
        for t in range(T):
            o, S = gla_step(q[:, t], k[:, t], v[:, t], g[:, t], S)
            outs.append(o)
        torch.stack(outs, 1).sum().backward()

    return run


def sdpa(T: int, H: int, D: int, seed: int = 0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, H, T, D, generator=gen).to(device).requires_grad_() for _ in range(3))

    def run():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    return run


def flops(form: str, T: int, H: int, K: int, V: int, chunk: int = 0) -> float:
    """Algorithmic FLOPs of forward + backward (backward counted as 2x forward; SDPA's as 2.5x)."""
    kv_state = 2 * K * V / H  # one [K_h, V_h] product per head, all heads
    if form == "sdpa":  # causal: half of QK^T and of PV, each 2*T*T*width
        return 3.5 * (2 * T * T * V)
    if form == "recurrent":  # state update + readout per token
        return 3 * T * 2 * kv_state
    # chunked: the full C x C score block and its product with v, plus state readout and update
    return 3 * T * (2 * chunk * K + 2 * chunk * V + 2 * kv_state)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--recurrent-repeats", type=int, default=2, help="the slow form gets fewer runs")
    ap.add_argument("--default-malloc", action="store_true", help="skip keep_cpu_allocations (to compare)")
    ap.add_argument(
        "--compile-chunk",
        type=int,
        default=0,
        help="also time torch.compile of the chunked form at this chunk (one compile per length)",
    )
    ap.add_argument(
        "--kernel",
        choices=["torch", "fla"],
        default="torch",
        help="fla: also time model.kernel fla (flash-linear-attention; needs CUDA and the [cuda] extra)",
    )
    add_device_argument(ap)
    args = ap.parse_args(argv)
    if args.kernel == "fla":
        from laplace.model.kernels import resolve_kernel

        resolve_kernel("fla", args.device)  # one line, now, where fla cannot run
    device, kept = prepare_device(args.device, keep_allocations=not args.default_malloc)

    cfg = preset_model_config("small", vocab_size=16384)
    H, K, V = cfg.n_heads, cfg.head_k_dim, cfg.head_v_dim
    peak = matmul_peak_gflops(device=device)
    result = {
        "machine": machine(device),
        "matmul_peak_gflops": peak,
        "heads": H,
        "head_k_dim": K,
        "head_v_dim": V,
        "sub_chunk_size": cfg.sub_chunk_size,
        "lengths": args.lengths,
        "kept_cpu_allocations": kept,
        "gla_chunked_s": {},
        "gla_recurrent_s": {},
        "sdpa_s": {},
        "gflops": {},
    }
    rows = []
    for T in args.lengths:
        torch.manual_seed(0)
        inputs = gla_inputs(T, H, K, V, device=device)
        per_chunk = {
            c: median_seconds(chunked(inputs, c, cfg.sub_chunk_size), args.repeats, device=device) for c in CHUNKS
        }
        # --recurrent-repeats 0 skips the O(T) Python loop (at 32k tokens it would take the whole budget)
        rec = (
            median_seconds(recurrent(inputs), args.recurrent_repeats, device=device) if args.recurrent_repeats else None
        )
        if args.kernel == "fla":
            fla = median_seconds(fla_chunked(inputs, cfg), args.repeats, warmup=2, device=device)
            result.setdefault("gla_fla_s", {})[str(T)] = fla
        att = median_seconds(sdpa(T, H, V, device=device), args.repeats, device=device)
        if args.compile_chunk:
            torch._dynamo.reset()
            compiled = median_seconds(
                chunked(inputs, args.compile_chunk, cfg.sub_chunk_size, compiled=True),
                args.repeats,
                warmup=2,
                device=device,
            )
            result.setdefault("gla_compiled_s", {})[str(T)] = compiled
        result["gla_chunked_s"][str(T)] = {str(c): s for c, s in per_chunk.items()}
        result["gla_recurrent_s"][str(T)] = rec
        result["sdpa_s"][str(T)] = att
        rates = {f"chunk{c}": flops("chunk", T, H, H * K, H * V, c) / s / 1e9 for c, s in per_chunk.items()}
        if rec is not None:
            rates["recurrent"] = flops("recurrent", T, H, H * K, H * V) / rec / 1e9
        rates["sdpa"] = flops("sdpa", T, H, H * K, H * V) / att / 1e9
        result["gflops"][str(T)] = rates
        best = min(per_chunk, key=per_chunk.get)
        rows.append(
            [
                T,
                *per_chunk.values(),
                *([compiled] if args.compile_chunk else []),
                *([fla, att / fla] if args.kernel == "fla" else []),
                "-" if rec is None else rec,
                att,
                att / per_chunk[best],
                "-" if rec is None else rec / per_chunk[best],
                rates[f"chunk{best}"] / peak,
                rates["sdpa"] / peak,
            ]
        )

    # the best chunk: fastest summed over all lengths
    totals = {c: sum(result["gla_chunked_s"][str(T)][str(c)] for T in args.lengths) for c in CHUNKS}
    best = min(totals, key=totals.get)
    result["chunk_best"] = best
    result["gla_best_s"] = {str(T): result["gla_chunked_s"][str(T)][str(best)] for T in args.lengths}
    first, last = str(args.lengths[0]), str(args.lengths[-1])
    if "2048" in result["sdpa_s"] and "8192" in result["sdpa_s"]:
        result["sdpa_over_gla_8192"] = result["sdpa_s"]["8192"] / result["gla_best_s"]["8192"]
        result["gla_8192_over_2048"] = result["gla_best_s"]["8192"] / result["gla_best_s"]["2048"]
        result["sdpa_8192_over_2048"] = result["sdpa_s"]["8192"] / result["sdpa_s"]["2048"]
        if result["gla_recurrent_s"]["2048"] is not None:
            result["recurrent_over_gla_2048"] = result["gla_recurrent_s"]["2048"] / result["gla_best_s"]["2048"]
    if args.kernel == "fla":  # the targets: >= 3x SDPA at 8,192 tokens, >= 10x at 32,768
        result["sdpa_over_fla"] = {T: result["sdpa_s"][T] / f for T, f in result["gla_fla_s"].items()}
    result["gla_growth"] = result["gla_best_s"][last] / result["gla_best_s"][first]
    result["sdpa_growth"] = result["sdpa_s"][last] / result["sdpa_s"][first]

    print(f"{device}: fp32 matmul peak {peak:.1f} GFLOP/s; seconds per forward+backward; best chunk {best}")
    compiled_header = [f"compiled{args.compile_chunk}"] if args.compile_chunk else []
    print_table(
        [
            "T",
            *(f"chunk{c}" for c in CHUNKS),
            *compiled_header,
            *(["fla", "sdpa/fla"] if args.kernel == "fla" else []),
            "recurrent",
            "sdpa",
            "sdpa/gla",
            "rec/gla",
            "gla/peak",
            "sdpa/peak",
        ],
        rows,
    )
    emit(result)


if __name__ == "__main__":
    main()
