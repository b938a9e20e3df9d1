"""Benchmark: Gated DeltaNet's chunked token mixing against GLA's, forward + backward, and the
decode step's cost against context for both.

At each sequence length (batch 1, fp32, the same head sizes for both: --heads, --head-k-dim,
--head-v-dim, chunk 64) it times, side by side in one run:
  - `chunk_gated_delta_rule` (the WY / UT-transform form: a triangular solve per chunk, then the
    chunk-to-chunk state recurrence),
  - `chunk_gla` (GLA's secondary-chunked form, sub-chunk 16),
and reports GDN / GLA. The paper's fused kernels cost a little more than GLA's; ours should stay
within 2x (`--max-ratio`: exit 1 above it at any length).

Decode: one token's step (`gated_delta_step`, `gla_step`) from the state a prefill of each
--decode-contexts length leaves; a fixed state has the same shape at every context, so the cost
per token must be flat (exit 1 when the longest context's step costs over --max-decode-ratio x the
shortest's). Prints a table and one JSON object.

    .venv/bin/python bench/gdn_vs_gla.py [--lengths 2048 8192] [--repeats 3] [--device cuda]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from laplace.model.gated_deltanet import chunk_gated_delta_rule, gated_delta_step, l2_normalize  # noqa: E402
from laplace.model.gla import chunk_gla, gla_step  # noqa: E402

from common import add_device_argument, emit, machine, median_seconds, prepare_device, print_table  # noqa: E402
from gla_scaling import gla_inputs  # noqa: E402  (the GLA benchmark's inputs: the model's gate)

CHUNK, SUB_CHUNK = 64, 16


def gdn_inputs(T: int, H: int, K: int, V: int, seed: int = 0, device="cpu"):
    """As the layer feeds the op: L2-normalised q, k; a log decay per head and token (Mamba2's
    -exp(A) softplus(dt) is negative); beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(1, T, H, K, generator=gen))
    k = l2_normalize(torch.randn(1, T, H, K, generator=gen))
    v = torch.randn(1, T, H, V, generator=gen)
    g = -F.softplus(torch.randn(1, T, H, generator=gen)) / 8
    beta = torch.rand(1, T, H, generator=gen)
    return [x.to(device).requires_grad_() for x in (q, k, v, g, beta)]


def gdn_forward_backward(inputs):
    def run():
        chunk_gated_delta_rule(*inputs, chunk_size=CHUNK)[0].sum().backward()

    return run


def gla_forward_backward(inputs):
    def run():
        chunk_gla(*inputs, chunk_size=CHUNK, sub_chunk_size=SUB_CHUNK)[0].sum().backward()

    return run


@torch.no_grad()
def decode_step_seconds(T: int, H: int, K: int, V: int, repeats: int, device) -> dict[str, float]:
    """Each family's one-token step from the state a T-token prefill leaves (median of `repeats`
    timings of 32 steps, per step)."""
    q, k, v, g, beta = (x.detach() for x in gdn_inputs(T + 32, H, K, V, seed=1, device=device))
    _, gdn_state = chunk_gated_delta_rule(q[:, :T], k[:, :T], v[:, :T], g[:, :T], beta[:, :T], chunk_size=CHUNK)
    gq, gk, gv, gg = (x.detach() for x in gla_inputs(T + 32, H, K, V, seed=1, device=device))
    _, gla_state = chunk_gla(gq[:, :T], gk[:, :T], gv[:, :T], gg[:, :T], chunk_size=CHUNK, sub_chunk_size=SUB_CHUNK)

    def gdn():
        s = gdn_state
        for t in range(T, T + 32):
            _, s = gated_delta_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], s)

    def gla():
        s = gla_state
        for t in range(T, T + 32):
            _, s = gla_step(gq[:, t], gk[:, t], gv[:, t], gg[:, t], s)

    return {name: median_seconds(fn, repeats, device=device) / 32 for name, fn in (("gdn", gdn), ("gla", gla))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-k-dim", type=int, default=128)
    ap.add_argument("--head-v-dim", type=int, default=256)
    ap.add_argument("--decode-contexts", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--max-ratio", type=float, default=2.0, help="GDN / GLA forward+backward, at most")
    ap.add_argument("--max-decode-ratio", type=float, default=1.25, help="step cost, longest / shortest context")
    add_device_argument(ap)
    args = ap.parse_args(argv)
    device, kept = prepare_device(args.device)
    H, K, V = args.heads, args.head_k_dim, args.head_v_dim
    result = {
        "machine": machine(device),
        "heads": H,
        "head_k_dim": K,
        "head_v_dim": V,
        "chunk_size": CHUNK,
        "kept_cpu_allocations": kept,
        "gdn_s": {},
        "gla_s": {},
        "gdn_over_gla": {},
        "decode_step_s": {},
    }
    rows = []
    for T in args.lengths:
        torch.manual_seed(0)
        gdn = median_seconds(gdn_forward_backward(gdn_inputs(T, H, K, V, device=device)), args.repeats, device=device)
        gla = median_seconds(gla_forward_backward(gla_inputs(T, H, K, V, device=device)), args.repeats, device=device)
        result["gdn_s"][str(T)], result["gla_s"][str(T)] = gdn, gla
        result["gdn_over_gla"][str(T)] = gdn / gla
        rows.append([T, gdn, gla, gdn / gla])
    print_table(["tokens", "GDN fwd+bwd s", "GLA fwd+bwd s", "GDN / GLA"], rows)
    for T in args.decode_contexts:
        result["decode_step_s"][str(T)] = decode_step_seconds(T, H, K, V, args.repeats, device)
    lo, hi = str(min(args.decode_contexts)), str(max(args.decode_contexts))
    flat = {f: result["decode_step_s"][hi][f] / result["decode_step_s"][lo][f] for f in ("gdn", "gla")}
    result["decode_step_ratio"] = {"contexts": [int(lo), int(hi)], **flat}
    print_table(
        ["context", "GDN step ms", "GLA step ms"],
        [[T, s["gdn"] * 1e3, s["gla"] * 1e3] for T, s in result["decode_step_s"].items()],
    )
    slow = {T: r for T, r in result["gdn_over_gla"].items() if r > args.max_ratio}
    grows = {f: r for f, r in flat.items() if r > args.max_decode_ratio}
    result["passed"] = not slow and not grows
    emit(result)
    if slow:
        print(f"GDN over {args.max_ratio}x GLA at {sorted(slow)} tokens: {slow}", file=sys.stderr)
    if grows:
        print(f"decode step cost grows with context ({hi} vs {lo} tokens): {grows}", file=sys.stderr)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
