"""Numerics checks: compiled vs eager vs an fp64 eager reference of the same weights.

On the exported model and held-out text, for fp32 and bf16 (`numerics.precisions`), on the three graphs that
matter: prefill (the chunked form, every position), the decode step at every warmed
width (with pad rows on the dummy slot), and one training step (loss and gradients; `numerics.train_step`).
The compiled path is the serving one: `engine.compile_scope` decides whether one GLA
block or the whole step is a graph (on CPU the decode steps are warmup's whole-step AOTInductor
packages where this process's compile cache holds them). Gates follow PyTorch's own practice for low
precision: fp32 compiled must sit within ~1e-5 of fp64; bf16 compiled must be no worse
than 1.5x eager's error against fp64, and agree on top-1 where the reference has a
clear margin. `numerics.mode: eager` adds a bitwise-reproducibility check of eager mode.

The numerics stage runs `run_numerics` in a fresh process started from the warmup compile cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from laplace.config import Config

# --------------------------------------------------------------------------- comparisons


def rel_rms(test: Tensor, ref: Tensor) -> float:
    t, r = test.double(), ref.double()
    return ((t - r).pow(2).mean().sqrt() / r.pow(2).mean().sqrt().clamp(min=1e-300)).item()


def compare_logits(eager: Tensor, compiled: Tensor, ref: Tensor, margin: float) -> dict:
    """Figures of two candidate logits [N, V] against each other and an fp64 reference."""
    eager, compiled, ref = eager.double(), compiled.double(), ref.double()
    top2 = ref.topk(2, dim=-1)
    ref_top1 = top2.indices[:, 0]
    clear = (top2.values[:, 0] - top2.values[:, 1]) >= margin
    lp = {
        name: F.log_softmax(x, dim=-1).gather(-1, ref_top1[:, None])[:, 0]
        for name, x in (("eager", eager), ("compiled", compiled), ("ref", ref))
    }
    e1, c1 = eager.argmax(-1), compiled.argmax(-1)

    def agree(a, b, where=None):
        eq = (a == b) if where is None else (a == b)[where]
        return eq.double().mean().item() if eq.numel() else 1.0

    return {
        "positions": int(ref.shape[0]),
        "rel_rms_eager_vs_fp64": rel_rms(eager, ref),
        "rel_rms_compiled_vs_fp64": rel_rms(compiled, ref),
        "max_abs_logit_diff": (compiled - eager).abs().max().item(),
        "max_logprob_diff_top1_compiled_vs_fp64": (lp["compiled"] - lp["ref"]).abs().max().item(),
        "max_logprob_diff_top1_eager_vs_fp64": (lp["eager"] - lp["ref"]).abs().max().item(),
        "logprob_diff_top1_compiled_vs_fp64_p99": (lp["compiled"] - lp["ref"]).abs().quantile(0.99).item(),
        "top1_compiled_vs_eager": agree(c1, e1),
        "top1_compiled_vs_fp64": agree(c1, ref_top1),
        "top1_eager_vs_fp64": agree(e1, ref_top1),
        "top1_compiled_vs_fp64_clear": agree(c1, ref_top1, clear),
        "top1_eager_vs_fp64_clear": agree(e1, ref_top1, clear),
        "top1_compiled_vs_eager_clear": agree(c1, e1, clear),
        "excluded_near_ties": int((~clear).sum()),
        "cosine_min_compiled_vs_fp64": F.cosine_similarity(compiled, ref, dim=-1).min().item(),
        "cosine_min_eager_vs_fp64": F.cosine_similarity(eager, ref, dim=-1).min().item(),
    }


# --------------------------------------------------------------------------- the three graphs


@torch.inference_mode()
def prefill_logits(model, tokens: Tensor) -> Tensor:
    """Every position's logits of the chunked form, [B*T, V]."""
    return model(tokens).flatten(0, 1)


@torch.inference_mode()
def decode_logits(engine, prompts: Tensor, continuation: Tensor, width: int, real: int) -> Tensor:
    """Teacher-forced decode at `width` with `real` sequences and width - real pad rows on the
    dummy slot. prompts [R, P], continuation [R, S] with R >= real. Returns real-row logits [S*real, V]."""
    engine.reset()
    out = []
    runner = engine.runner
    with engine.cache.leased(range(real)) as slots:
        for i, slot in enumerate(slots):
            runner.prefill(slot, prompts[i])
        for t in range(continuation.shape[1]):
            out.append(runner.decode_rows(slots, continuation[:real, t], width).float().cpu())
    engine.reset()
    return torch.cat(out)


def train_step(model, tokens: Tensor, autocast_bf16: bool) -> tuple[float, Tensor]:
    """Loss and the concatenated gradients of one training step (no optimizer update)."""
    from laplace.training.loop import cross_entropy

    model.zero_grad(set_to_none=True)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast_bf16 else contextlib.nullcontext()
    with ctx:
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    grads = torch.cat([p.grad.detach().double().flatten() for p in model.parameters() if p.grad is not None])
    return loss.item(), grads


@torch.inference_mode()
def greedy_tokens(engine, prompt: list[int], n: int) -> tuple[list[int], list[Tensor]]:
    """Greedy continuation through an engine at width 1, with the logits of each step."""
    from laplace.serving.replay import replay
    from laplace.serving.scheduler import Request

    engine.reset()
    logits_seen: list[Tensor] = []
    engine.on_logits = lambda logits: logits_seen.append(logits[0].float().cpu())
    try:
        done = replay(engine, [Request(0, prompt, n)])
    finally:
        engine.on_logits = None
    return done[0].output_ids, logits_seen


def greedy_report(eager_engine, compiled_engine, prompts: list[list[int]], n: int) -> dict:
    """How many tokens compiled and eager greedy decoding agree on, per prompt; at the first
    divergence, whether each side's token is in the other's top 5."""
    lengths, divergences = [], []
    for i, prompt in enumerate(prompts):
        a, la = greedy_tokens(eager_engine, prompt, n)
        b, lb = greedy_tokens(compiled_engine, prompt, n)
        same = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        lengths.append(same)
        if same < n:
            divergences.append(
                {
                    "prompt": i,
                    "position": same,
                    "compiled_token_in_eager_top5": bool(b[same] in la[same].topk(5).indices),
                    "eager_token_in_compiled_top5": bool(a[same] in lb[same].topk(5).indices),
                }
            )
    return {
        "agreement_tokens": lengths,
        "mean_agreement": sum(lengths) / (len(lengths) * n),
        "divergences": divergences,
    }


# --------------------------------------------------------------------------- models


def compiled_model(model, scope: str, backend: str):
    """The compiled path of `model` (compiled in place): its blocks, or its whole forward."""
    from laplace.runtime import compile_static

    if scope == "block":
        for block in model.blocks:
            compile_static(block, backend)
        return model
    return compile_static(model, backend)


def reference(cfg: Config, ref_model, held_out: Tensor) -> dict:
    """The fp64 eager figures every candidate is compared with (computed once)."""
    from laplace.serving.engine import DecodeEngine

    n = cfg.numerics
    engine = DecodeEngine(ref_model, cfg.engine, "eager")
    prompts, cont = held_out[:, : n.prompt_tokens], held_out[:, n.prompt_tokens : n.prompt_tokens + n.decode_tokens]
    ref = {"prefill": prefill_logits(ref_model, held_out[: n.batch_size, : n.seq_len]), "decode": {}}
    for width in engine.scheduler.ladder:
        ref["decode"][width] = decode_logits(engine, prompts, cont, width, max(1, width // 2))
    if n.train_step:
        ref_model.train()
        ref["train"] = train_step(ref_model, held_out[: n.batch_size, : n.seq_len + 1], False)
        ref_model.eval()
    return ref


def check_dtype(
    cfg: Config, export_dir: Path, dtype: torch.dtype, held_out: Tensor, ref: dict, corrupt_compiled=None
) -> dict:
    """Every comparison for one serving dtype against the fp64 `ref`. `corrupt_compiled(model)`
    (tests) breaks the compiled side only, to prove the gates can fail."""
    from laplace.model.export import load_export
    from laplace.runtime import compile_backend
    from laplace.serving.engine import DecodeEngine

    n = cfg.numerics
    backend = compile_backend(torch.device("cpu"))
    eager, _, _ = load_export(export_dir, dtype=dtype)
    comp_base, _, _ = load_export(export_dir, dtype=dtype)
    if corrupt_compiled is not None:
        corrupt_compiled(comp_base)
    eager_engine = DecodeEngine(eager, cfg.engine, "eager")
    comp_engine = DecodeEngine(comp_base, cfg.engine, "padded", backend=backend)
    compiled = comp_base if cfg.engine.compile_scope == "block" else compiled_model(comp_base, "model", backend)
    out: dict = {}
    seconds: dict[str, float] = {}

    started = time.perf_counter()
    tokens = held_out[: n.batch_size, : n.seq_len]
    out["prefill"] = compare_logits(
        prefill_logits(eager, tokens), prefill_logits(compiled, tokens), ref["prefill"], n.margin
    )
    seconds["prefill"] = time.perf_counter() - started

    started = time.perf_counter()
    prompts, cont = held_out[:, : n.prompt_tokens], held_out[:, n.prompt_tokens : n.prompt_tokens + n.decode_tokens]
    out["decode"] = {}
    for width in comp_engine.scheduler.ladder:
        real = max(1, width // 2)  # half the rows are padding (dummy slot)
        c = decode_logits(comp_engine, prompts, cont, width, real)
        report = compare_logits(
            decode_logits(eager_engine, prompts, cont, width, real), c, ref["decode"][width], n.margin
        )
        report["real_rows"] = real
        if real < width and real in comp_engine.scheduler.ladder:  # the same rows computed without padding
            unpadded = decode_logits(comp_engine, prompts, cont, real, real)
            report["padded_vs_unpadded_max_abs"] = (c - unpadded).abs().max().item()
        out["decode"][str(width)] = report
    seconds["decode"] = time.perf_counter() - started

    if n.train_step:
        started = time.perf_counter()
        out["train_step"] = check_train_step(cfg, export_dir, dtype, held_out, ref, corrupt_compiled)
        seconds["train_step"] = time.perf_counter() - started

    started = time.perf_counter()
    texts = [held_out[i, : n.prompt_tokens].tolist() for i in range(min(n.greedy_prompts, held_out.shape[0]))]
    out["greedy"] = greedy_report(eager_engine, comp_engine, texts, n.greedy_tokens)
    seconds["greedy"] = time.perf_counter() - started
    out["seconds"] = seconds
    print("  " + ", ".join(f"{k} {v:.1f}s" for k, v in seconds.items()), flush=True)
    return out


def check_train_step(
    cfg: Config, export_dir: Path, dtype: torch.dtype, held_out: Tensor, ref: dict, corrupt_compiled=None
) -> dict:
    """One training step on fp32 master weights (bf16 means autocast, as train.precision: bf16):
    loss and gradients, compiled vs eager vs the fp64 `ref`."""
    from laplace.model.export import load_export
    from laplace.runtime import compile_backend

    n = cfg.numerics
    backend = compile_backend(torch.device("cpu"))
    bf16 = dtype == torch.bfloat16
    train_eager, _, _ = load_export(export_dir, dtype=torch.float32)
    train_comp_base, _, _ = load_export(export_dir, dtype=torch.float32)
    if corrupt_compiled is not None:
        corrupt_compiled(train_comp_base)
    train_comp = compiled_model(train_comp_base, cfg.engine.compile_scope, backend)
    train_eager.train()
    train_comp_base.train()
    batch = held_out[: n.batch_size, : n.seq_len + 1]
    loss_e, g_e = train_step(train_eager, batch, bf16)
    loss_c, g_c = train_step(train_comp, batch, bf16)
    loss_r, g_r = ref["train"]
    return {
        "loss_eager": loss_e,
        "loss_compiled": loss_c,
        "loss_fp64": loss_r,
        "loss_rel_diff_compiled_vs_fp64": abs(loss_c - loss_r) / abs(loss_r),
        "loss_rel_diff_eager_vs_fp64": abs(loss_e - loss_r) / abs(loss_r),
        "grad_rel_rms_eager_vs_fp64": rel_rms(g_e, g_r),
        "grad_rel_rms_compiled_vs_fp64": rel_rms(g_c, g_r),
        "grad_max_abs_diff_compiled_vs_eager": (g_c - g_e).abs().max().item(),
    }


# --------------------------------------------------------------------------- gates


def dtype_gates(cfg: Config, name: str, report: dict) -> dict[str, tuple[bool, float, str]]:
    """The gates of one dtype's report: name -> (passed, value, threshold)."""
    n = cfg.numerics
    g: dict[str, tuple[bool, float, str]] = {}
    graphs = [("prefill", report["prefill"])] + [(f"decode@{w}", r) for w, r in report["decode"].items()]
    if name == "fp32":
        for graph, r in graphs:
            v = r["rel_rms_compiled_vs_fp64"]
            g[f"fp32 {graph} compiled vs fp64 rel RMS"] = (v <= n.fp32_rel_rms_max, v, f"<= {n.fp32_rel_rms_max:g}")
            v = r["top1_compiled_vs_eager_clear"]
            g[f"fp32 {graph} top-1 compiled vs eager (clear margin)"] = (
                v >= n.fp32_top1_min,
                v,
                f">= {n.fp32_top1_min:g}",
            )
        if "train_step" in report:  # numerics.train_step
            v = report["train_step"]["grad_rel_rms_compiled_vs_fp64"]
            g["fp32 train-step gradients compiled vs fp64 rel RMS"] = (
                v <= n.grad_rel_rms_fp32_max,
                v,
                f"<= {n.grad_rel_rms_fp32_max:g}",
            )
        return g
    for graph, r in graphs:  # bf16: judged against eager's own error, PyTorch-style
        ratio = r["rel_rms_compiled_vs_fp64"] / max(r["rel_rms_eager_vs_fp64"], 1e-12)
        g[f"bf16 {graph} compiled error / eager error"] = (
            ratio <= n.bf16_error_ratio_max,
            ratio,
            f"<= {n.bf16_error_ratio_max:g}",
        )
        v = r["top1_compiled_vs_fp64_clear"]
        g[f"bf16 {graph} top-1 compiled vs fp64 (clear margin)"] = (v >= n.bf16_top1_min, v, f">= {n.bf16_top1_min:g}")
    if "train_step" in report:
        ts = report["train_step"]
        ratio = ts["grad_rel_rms_compiled_vs_fp64"] / max(ts["grad_rel_rms_eager_vs_fp64"], 1e-12)
        g["bf16 train-step gradient error compiled / eager"] = (
            ratio <= n.bf16_error_ratio_max,
            ratio,
            f"<= {n.bf16_error_ratio_max:g}",
        )
    return g


def gates(cfg: Config, result: dict) -> dict[str, tuple[bool, float, str]]:
    g = {k: v for name in cfg.numerics.precisions for k, v in dtype_gates(cfg, name, result[name]).items()}
    if "reproducibility" in result:
        ok = result["reproducibility"]["bitwise_identical"]
        g["eager mode bitwise reproducible"] = (ok, float(ok), "== 1")
    return g


def gate_table(g: dict[str, tuple[bool, float, str]]) -> str:
    width = max(len(k) for k in g)
    lines = [f"{'gate':<{width}}  {'value':>12}  {'threshold':<10}  result", "-" * (width + 36)]
    for name, (ok, value, threshold) in g.items():
        lines.append(f"{name:<{width}}  {value:>12.4g}  {threshold:<10}  {'pass' if ok else 'FAIL'}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- reproducibility


def eager_fingerprint(export_dir: Path, tokens: Tensor, n_tokens: int, seed: int) -> dict:
    """Logits and greedy tokens of eager fp32 at a fixed batch width, under deterministic algorithms."""
    from laplace.model.export import load_export
    from laplace.runtime import set_determinism
    from laplace.serving.generation import generate_ids

    set_determinism(seed)
    model, _, _ = load_export(export_dir, dtype=torch.float32)
    with torch.inference_mode():
        logits = model(tokens)
    ids = generate_ids(model, tokens[0, :16].tolist(), n_tokens, temperature=0.0)
    return {
        "logits_sha256": hashlib.sha256(logits.numpy().tobytes()).hexdigest(),
        "tokens_sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest(),
        "logits": logits,
    }


def reproducibility(export_dir: Path, held_out: Tensor, seed: int) -> dict:
    """Two eager runs at a fixed width are bit-identical; a different batch width is not guaranteed."""
    tokens = held_out[:2, :64]
    a = eager_fingerprint(export_dir, tokens, 16, seed)
    b = eager_fingerprint(export_dir, tokens, 16, seed)
    alone = eager_fingerprint(export_dir, tokens[:1], 16, seed)
    torch.use_deterministic_algorithms(False)
    return {
        "bitwise_identical": a["logits_sha256"] == b["logits_sha256"] and a["tokens_sha256"] == b["tokens_sha256"],
        "logits_sha256": a["logits_sha256"],
        "tokens_sha256": a["tokens_sha256"],
        "row0_width1_vs_width2_max_abs": (alone["logits"][0] - a["logits"][0]).abs().max().item(),
    }


# --------------------------------------------------------------------------- all checks


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def run_numerics(cfg: Config, export_dir: Path, data_dir: Path, corrupt_compiled=None) -> dict:
    import numpy as np

    from laplace.config import width_ladder
    from laplace.data.shards import open_split
    from laplace.model.export import load_export
    from laplace.runtime import configure_compiler

    n = cfg.numerics
    torch.manual_seed(n.seed)
    configure_compiler(4 * (len(width_ladder(cfg.engine.max_slots, cfg.engine.widths)) + 4))
    val = open_split(data_dir, "val")
    need = max(n.seq_len + 1, n.prompt_tokens + n.decode_tokens)
    rows = max(n.batch_size, max(width_ladder(cfg.engine.max_slots, cfg.engine.widths)))
    rng = np.random.default_rng(n.seed)
    starts = rng.integers(0, len(val) - need, size=rows)
    held_out = torch.as_tensor(np.stack([np.asarray(val[s : s + need], dtype=np.int64) for s in starts]))
    ref_model, _, _ = load_export(export_dir, dtype=torch.float64)
    started = time.perf_counter()
    ref = reference(cfg, ref_model, held_out)
    result: dict = {
        "compile_scope": cfg.engine.compile_scope,
        "mode": n.mode,
        "reference_seconds": time.perf_counter() - started,
    }
    for name in n.precisions:
        started = time.perf_counter()
        result[name] = check_dtype(cfg, export_dir, DTYPES[name], held_out, ref, corrupt_compiled)
        print(f"{name}: checked in {time.perf_counter() - started:.1f}s", flush=True)
    if n.mode == "eager":
        result["reproducibility"] = reproducibility(export_dir, held_out, n.seed)
    g = gates(cfg, result)
    result["gates"] = {k: {"passed": ok, "value": v, "threshold": t} for k, (ok, v, t) in g.items()}
    result["gate_table"] = gate_table(g)
    result["passed"] = all(ok for ok, _, _ in g.values())
    for name in n.precisions:  # the headline figures, flat (MLflow metrics, the summary)
        r = result[name]
        result[f"max_abs_logit_diff_{name}"] = max(
            [r["prefill"]["max_abs_logit_diff"]] + [d["max_abs_logit_diff"] for d in r["decode"].values()]
        )
        result[f"greedy_agreement_{name}"] = r["greedy"]["mean_agreement"]
        result[f"rel_rms_{name}_compiled_vs_fp64"] = r["prefill"]["rel_rms_compiled_vs_fp64"]
    if "bf16" in result:
        result["rel_rms_bf16_eager_vs_fp64"] = result["bf16"]["prefill"]["rel_rms_eager_vs_fp64"]
    return result
