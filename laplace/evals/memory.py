"""Memory accounting: state bytes measured from the live State tensors vs the formula, the KV
cache a same-size transformer would need, process RSS while decoding after growing contexts
(flat for a GLA), and the Laplace 3B figures from modules on the meta device."""

from __future__ import annotations

import numpy as np
import torch

from laplace.model.config import ModelConfig, preset_model_config
from laplace.model.lm import LaplaceLM, State, analytic_kv_bytes, analytic_state_bytes, kv_cache_bytes, torch_dtype
from laplace.progress import progress_bar
from laplace.serving.engine import DecodeEngine


def rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def meta_facts(cfg: ModelConfig) -> dict:
    """Parameters and state bytes from the real modules on the meta device (nothing allocated)."""
    with torch.device("meta"):
        model = LaplaceLM(cfg)
    state = State.allocate(cfg, batch=1, device="meta", dtype=torch_dtype(cfg.dtype), max_context=0)
    return {
        "params": model.num_parameters(),
        "state_bytes": state.bytes_per_sequence,
        "state_bytes_analytic": analytic_state_bytes(cfg),
    }


@torch.inference_mode()
def decode_rss(
    engine: DecodeEngine, contexts: list[int], decode_steps: int = 16, text=None, progress: bool = True
) -> dict[int, int]:
    """Process RSS while decoding at width 1 after a prompt of each context length.

    The prompt (repeated `text`, or a fixed token) is prefilled (in bucket pieces) into one
    slot; the highest RSS seen over `decode_steps` greedy decode steps is recorded. A GLA
    decodes from a fixed-size state, so this should not grow with the context."""
    out = {}
    runner = engine.runner
    source = np.asarray(text if text is not None and len(text) else [runner.pad_id], dtype=np.int64)
    for ctx in progress_bar(contexts, desc="decode memory", unit="context", enabled=progress):
        prompt = np.resize(source, ctx)
        with engine.cache.leased([-1]) as (slot,):
            token = runner.prefill(slot, prompt).argmax(-1)
            peak = 0
            for _ in range(decode_steps):
                token = runner.decode_rows([slot], token).argmax(-1)
                peak = max(peak, rss_bytes())
            out[ctx] = peak
    return out


def memory_report(
    model: LaplaceLM,
    engine: DecodeEngine,
    contexts: list[int],
    kv_contexts: list[int],
    cfg_3b: ModelConfig | None = None,
    decode_steps: int = 16,
    text=None,
    progress: bool = True,
) -> dict:
    """State bytes (measured vs formula), the KV cache of a same-size transformer, decode RSS vs
    context, and the Laplace 3B figures (modules on the meta device, nothing allocated)."""
    cfg = model.cfg
    cfg_3b = cfg_3b or preset_model_config("laplace-3b")
    dtype = next(model.parameters()).dtype
    rss = decode_rss(engine, contexts, decode_steps, text, progress) if contexts else {}
    facts_3b = meta_facts(cfg_3b)
    kv_3b_8192 = kv_cache_bytes(cfg_3b, 8192)
    state = engine.cache.state  # the slots' rows, measured
    return {
        "state_bytes_measured": state.bytes_per_sequence,
        "state_bytes_analytic": analytic_state_bytes(cfg, dtype),
        # a hybrid's slots also hold K/V up to engine.max_context (0 for GLA): measured vs formula
        "kv_bytes_measured": state.kv_bytes_per_sequence,
        "kv_bytes_analytic": analytic_kv_bytes(cfg, state.max_context, dtype),
        "kv_bytes": {c: kv_cache_bytes(cfg, c) for c in kv_contexts},
        "kv_bytes_8192": kv_cache_bytes(cfg, 8192),
        "decode_rss_bytes": rss,
        "decode_rss_flat_ratio": max(rss.values()) / min(rss.values()) if rss else None,
        "laplace_3b_params": facts_3b["params"],
        "laplace_3b_state_bytes": facts_3b["state_bytes"],
        "laplace_3b_state_bytes_analytic": facts_3b["state_bytes_analytic"],
        "laplace_3b_kv_bytes_8192": kv_3b_8192,
        "laplace_3b_state_vs_kv_8192": kv_3b_8192 / facts_3b["state_bytes"] if facts_3b["state_bytes"] else None,
        # for the plot: the two configurations the curves are drawn for
        "model_config": cfg.to_dict(),
        "laplace_3b_config": cfg_3b.to_dict(),
    }
