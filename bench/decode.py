"""Benchmark: decode cost against context length, GLA's fixed state vs a transformer's KV cache.

For each context (default 512, 2,048 and 8,192 tokens) the model (default the `small`
preset, fp32, eager, inference mode) prefills one real sequence of that length, then
the state it ends with is copied into every row of a batch and decode steps are timed
at widths 1..32. Contexts are measured in interleaved rounds so drift hits them alike.
Side by side, at width 1: one decode token's attention over a KV cache of the same
length for a transformer of the same layers and width (`scaled_dot_product_attention`,
all layers), the cost our state avoids. Also the state bytes per sequence (the real
State tensors) vs the KV cache a transformer keeps. Prints a table and one JSON object.

    .venv/bin/python bench/decode.py [--preset small] [--contexts 512 2048 8192]
        [--widths 1 2 4 8 16 32] [--device cuda] [--engine]

`--engine` times the serving engine's decode step instead (laplace.serving.engine: the whole
step, sampler included, compiled per width; with CUDA graphs on CUDA), tokens read back once
per step.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from laplace.model.config import preset_model_config  # noqa: E402
from laplace.model.lm import LaplaceLM, State, kv_cache_bytes  # noqa: E402

from common import add_device_argument, emit, machine, prepare_device, print_table, synchronize  # noqa: E402

VOCAB = {"tiny": 4096, "small": 16384, "laplace-3b": 50304}


def state_after(model: LaplaceLM, context: int, seed: int, prefill_chunk: int = 2048) -> State:
    """The state after prefilling `context` random tokens (in pieces, continuing the state)."""
    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    tokens = torch.randint(0, model.cfg.vocab_size, (1, context), generator=gen).to(device)
    state = model.allocate_state(1)
    for start in range(0, context, prefill_chunk):
        model.prefill(tokens[:, start : start + prefill_chunk], state)
    return state


def widened(state: State, width: int) -> State:
    """`width` copies of a one-sequence state."""
    return state.select(torch.zeros(width, dtype=torch.long, device=state.recurrent.device))


def time_decode(model: LaplaceLM, state: State, steps: int, seed: int) -> float:
    """Median seconds of one decode step (one token for every row)."""
    gen = torch.Generator().manual_seed(seed)
    device = state.recurrent.device
    tokens = torch.randint(0, model.cfg.vocab_size, (state.batch_size,), generator=gen).to(device)
    times = []
    for _ in range(steps + 1):
        synchronize(device)
        start = time.perf_counter()
        logits = model.decode_step(tokens, state)
        synchronize(device)
        times.append(time.perf_counter() - start)
        tokens = logits.argmax(-1)
    return statistics.median(times[1:])


def time_engine_decode(engine, state: State, width: int, steps: int, seed: int) -> float:
    """Median seconds of one step of the serving engine's decode graph (model, state writes and
    the on-device sampler; CUDA graphs on CUDA) on `width` slots holding `state`, the produced
    tokens read back once per step as the engine reads them."""
    from laplace.serving.model_runner import DecodeBatch

    slots = torch.arange(width, device=engine.device)
    engine.cache.state.recurrent[:, :width] = state.recurrent
    if state.conv is not None:
        engine.cache.state.conv[:, :width] = state.conv
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, engine.model.cfg.vocab_size, (width,), generator=gen).to(engine.device)
    greedy = torch.zeros(width, device=engine.device), torch.ones(width, device=engine.device)
    keys = torch.zeros(width, dtype=torch.long, device=engine.device)
    times = []
    for _ in range(steps + 1):
        synchronize(engine.device)
        start = time.perf_counter()
        next_tokens = engine.runner.decode_step(DecodeBatch.stack(tokens, slots, keys, *greedy))[0].tolist()
        times.append(time.perf_counter() - start)
        tokens = torch.tensor(next_tokens, device=engine.device)
    return statistics.median(times[1:])


def kv_attention_seconds(cfg, context: int, steps: int, device) -> float:
    """One decode token's softmax attention over `context` cached keys/values, every layer."""
    H, D = cfg.n_heads, cfg.d_model // cfg.n_heads
    gen = torch.Generator().manual_seed(0)
    caches = [
        (
            torch.randn(1, H, context, D, generator=gen).to(device),
            torch.randn(1, H, context, D, generator=gen).to(device),
        )
        for _ in range(cfg.n_layers)
    ]
    q = torch.randn(1, H, 1, D, generator=gen).to(device)
    times = []
    for _ in range(steps + 1):
        synchronize(device)
        start = time.perf_counter()
        for k, v in caches:
            F.scaled_dot_product_attention(q, k, v)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--steps", type=int, default=10, help="timed decode steps per (context, width, round)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--engine",
        action="store_true",
        help="time the serving engine's compiled decode step (CUDA graphs on CUDA) instead of eager decode_step",
    )
    add_device_argument(ap)
    args = ap.parse_args(argv)
    device, kept = prepare_device(args.device)
    torch.manual_seed(0)
    cfg = preset_model_config(args.preset, vocab_size=VOCAB.get(args.preset, 16384), dtype="float32")
    model = LaplaceLM(cfg).to(device).eval()
    with torch.inference_mode():
        prefill_s, states = {}, {}
        for c in args.contexts:
            start = time.perf_counter()
            states[c] = state_after(model, c, seed=c)
            prefill_s[c] = time.perf_counter() - start
        samples = {(c, w): [] for c in args.contexts for w in args.widths}
        engine = None
        if args.engine:
            from laplace.config import EngineSection
            from laplace.serving.engine import DecodeEngine

            ladder = sorted(set(args.widths))
            shapes = dict(max_slots=ladder[-1], widths=ladder, prefill_buckets=[16], max_prompt_tokens=16)
            params = dataclasses.replace(EngineSection(), **shapes, compile_scope="model", prefix_cache_bytes=0)
            engine = DecodeEngine(model, params, "padded")
            start = time.perf_counter()
            engine.runner.warmup(widths=ladder, buckets=[])
            compile_s = time.perf_counter() - start
        for r in range(args.rounds):
            for w in args.widths:
                for c in args.contexts:
                    if engine is not None:
                        seconds = time_engine_decode(engine, states[c], w, args.steps, seed=r)
                    else:
                        seconds = time_decode(model, widened(states[c], w), args.steps, seed=r)
                    samples[(c, w)].append(seconds)
        step_s = {key: statistics.median(v) for key, v in samples.items()}
        kv_s = {c: kv_attention_seconds(cfg, c, args.steps, device) for c in args.contexts}

    lo, hi = min(args.contexts), max(args.contexts)
    per_width_ratio = {w: step_s[(hi, w)] / step_s[(lo, w)] for w in args.widths}
    state_bytes = states[lo].bytes_per_sequence
    result = {
        "machine": machine(device),
        "kept_cpu_allocations": kept,
        "preset": args.preset,
        "mode": "engine (compiled step, CUDA graphs on CUDA)" if engine is not None else "eager decode_step",
        "engine_warmup_s": compile_s if engine is not None else None,
        "params": sum(p.numel() for p in model.parameters()),
        "decode_s_per_step": {str(c): {str(w): step_s[(c, w)] for w in args.widths} for c in args.contexts},
        "decode_s_per_token": {str(c): {str(w): step_s[(c, w)] / w for w in args.widths} for c in args.contexts},
        "prefill_s": {str(c): s for c, s in prefill_s.items()},
        f"ratio_{hi}_vs_{lo}_by_width": {str(w): r for w, r in per_width_ratio.items()},
        f"ratio_{hi}_vs_{lo}": sum(step_s[(hi, w)] for w in args.widths) / sum(step_s[(lo, w)] for w in args.widths),
        "kv_attention_s_per_token": {str(c): s for c, s in kv_s.items()},
        f"kv_attention_ratio_{hi}_vs_{lo}": kv_s[hi] / kv_s[lo],
        "state_bytes_per_sequence": state_bytes,
        "kv_cache_bytes_bf16": {str(c): kv_cache_bytes(cfg, c) for c in args.contexts},
        "state_vs_kv": {str(c): kv_cache_bytes(cfg, c) / state_bytes for c in args.contexts},
    }
    how = "the engine's compiled step" if engine is not None else "eager"
    print(f"{args.preset} on {device}: {result['params'] / 1e6:.1f}M parameters, fp32, {how}; seconds per decode step")
    rows = [
        [c, *(step_s[(c, w)] for w in args.widths), kv_s[c], state_bytes, kv_cache_bytes(cfg, c)] for c in args.contexts
    ]
    print_table(["context", *(f"w={w}" for w in args.widths), "kv attn (w=1)", "state B", "kv B (bf16)"], rows)
    print(
        f"decode {hi} vs {lo}: {result[f'ratio_{hi}_vs_{lo}']:.3f} (per width "
        + ", ".join(f"{w}: {r:.3f}" for w, r in per_width_ratio.items())
        + ")"
    )
    emit(result)


if __name__ == "__main__":
    main()
