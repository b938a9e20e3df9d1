"""Facts of a model configuration measured from the real modules and State tensors on the meta
device (nothing is allocated): parameters, state bytes per sequence, the KV-cache comparison, and
what one sequence holds at 2k, 8k and 32k tokens for any architecture (GLA and Gated DeltaNet
state, attention K/V)."""

from __future__ import annotations

import torch

from laplace.model.config import ModelConfig
from laplace.model.lm import LaplaceLM, State, kv_cache_bytes, sequence_bytes, torch_dtype

CONTEXTS = (2048, 8192, 32768)


def model_facts(model_cfg: ModelConfig) -> dict:
    with torch.device("meta"):  # count real modules without allocating 3B parameters
        model = LaplaceLM(model_cfg)
    dtype = torch_dtype(model_cfg.dtype)
    state = State.allocate(model_cfg, batch=1, device="meta", dtype=dtype, max_context=CONTEXTS[1])
    params = model.num_parameters()
    embedding = model.embed.weight.numel() + (0 if model_cfg.tie_embeddings else model.lm_head.weight.numel())
    kv = kv_cache_bytes(model_cfg, 8192, bytes_per_value=2)
    return {
        "params": params,
        "params_non_embedding": params - embedding,
        "state_bytes_per_sequence": state.bytes_per_sequence,
        "state_recurrent_bytes": state.recurrent.numel() * state.recurrent.element_size(),
        "state_conv_bytes": 0 if state.conv is None else state.conv.numel() * state.conv.element_size(),
        # the Gated DeltaNet layers' matrix state and short-convolution state (0 without such layers)
        "state_delta_bytes": _nbytes(state.delta),
        "state_delta_conv_bytes": _nbytes(state.delta_conv),
        "kv_cache_bytes_8192": kv,
        "state_vs_kv_8192": kv / state.bytes_per_sequence if state.bytes_per_sequence else None,
        "attn_layers": list(model_cfg.attn_layers),
        "gla_layers": list(model_cfg.gla_layers),
        "gdn_layers": list(model_cfg.gdn_layers),
        # measured on the real State (meta) at 8k, and the formula at each length
        "kv_bytes_per_sequence_8192": state.kv_bytes_per_sequence,
        "per_sequence": {n: sequence_bytes(model_cfg, n, dtype) for n in CONTEXTS},
        "config": model_cfg.to_dict(),
    }


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()
