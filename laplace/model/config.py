"""The architecture of a GLA language model and its presets, beside the model.

Knows nothing of params files: `laplace.config` builds a ModelConfig from the `model:`
section, tests and benchmarks build one directly.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from laplace.errors import ConfigError


def _doc(default=dataclasses.MISSING, doc: str = ""):
    """A field with its one-line doc: laplace.config makes every field a `model:` knob documented by it."""
    return dataclasses.field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a GLA language model (fla conventions)."""

    vocab_size: int = _doc(doc="empty: the preset's, else the tokenizer's")
    d_model: int = _doc(doc="hidden size")
    n_layers: int = _doc(doc="GLA blocks")
    n_heads: int = _doc(doc="attention heads; d_model * expand_k and d_model * expand_v divide by it")
    expand_k: float = _doc(0.5, "key dimension = d_model * expand_k")
    expand_v: float = _doc(1.0, "value dimension = d_model * expand_v")
    mlp_hidden: int = _doc(0, "0: fla's rule, 4 * d_model * 2/3 rounded up to a multiple of 256")
    gate_low_rank_dim: int = _doc(16, "rank of the forget-gate projection")
    gate_logit_normalizer: float = _doc(16.0, "forget-gate logits are divided by this")
    gate_clamp_min: float | None = _doc(
        -10.0,
        "floor of the forget gate's log decay (fla's clamp_min; null in an import: no clamp, fla's default); "
        "-10 is where the torch chunked form is exact",
    )
    gate_bias_init: float = _doc(0.0, "> 0 starts the forget gates near 1 (long memory)")
    use_short_conv: bool = _doc(True, "a short causal convolution on q, k and v")
    conv_size: int = _doc(4, "its kernel size")
    norm_eps: float = _doc(1e-6, "epsilon of the RMS norms")
    chunk_size: int = _doc(64, "tokens per chunk of the chunked (training and prefill) form")
    sub_chunk_size: int = _doc(16, "sub-chunk of the chunked form; divides chunk_size, at most 32")
    segment_len: int = _doc(2048, "long sequences run in segments of this many tokens carrying the state")
    tie_embeddings: bool = _doc(False, "the output head shares the embedding matrix")
    init_std: float = _doc(0.02, "standard deviation of the initial weights")
    dtype: str = _doc("float32", "float32 | bfloat16 | float16 | float64: parameters, activations, conv cache")
    # How the GLA core runs, not what the model is (laplace.model.kernels). Left out of exports
    # and of the training run's fingerprint.
    kernel: str = _doc(
        "auto",
        "the GLA core: torch (plain PyTorch, any device) | fla (flash-linear-attention's Triton kernels: CUDA, "
        "pip install 'laplace[cuda]') | auto (fla on CUDA when installed, else torch)",
    )

    @property
    def key_dim(self) -> int:
        return int(self.d_model * self.expand_k)

    @property
    def value_dim(self) -> int:
        return int(self.d_model * self.expand_v)

    @property
    def head_k_dim(self) -> int:
        return self.key_dim // self.n_heads

    @property
    def head_v_dim(self) -> int:
        return self.value_dim // self.n_heads

    @property
    def ffn_dim(self) -> int:
        if self.mlp_hidden:
            return self.mlp_hidden
        raw = int(self.d_model * 4 * 2 / 3)
        return 256 * math.ceil(raw / 256)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def architecture(self) -> dict:
        """Every field that decides the weights and the function they compute (not `kernel`)."""
        return {k: v for k, v in self.to_dict().items() if k not in RUNTIME_FIELDS}


PRESETS: dict[str, dict[str, Any]] = {
    # ~5.5M parameters with a 4k vocabulary: trains in minutes on 2 CPU cores.
    "tiny": dict(vocab_size=0, d_model=256, n_layers=4, n_heads=4, chunk_size=64),
    # ~110M parameters with a 16k vocabulary (GPT-2 small shape): benchmarks.
    "small": dict(vocab_size=0, d_model=768, n_layers=12, n_heads=6, chunk_size=64),
    # Laplace 3B: 24 layers, hidden 3072; see README "Reproducing the 3B figures".
    "laplace-3b": dict(vocab_size=50304, d_model=3072, n_layers=24, n_heads=16, chunk_size=128, dtype="bfloat16"),
}

MODEL_DTYPES = ("float32", "bfloat16", "float16", "float64")
KERNELS = ("auto", "torch", "fla")  # laplace.model.kernels
RUNTIME_FIELDS = ("kernel",)


def validate_model_config(m: ModelConfig, prefix: str = "model") -> ModelConfig:
    def bad(key: str, why: str):
        raise ConfigError(f"{prefix}.{key}: {why}")

    for key in (
        "vocab_size",
        "d_model",
        "n_layers",
        "n_heads",
        "gate_low_rank_dim",
        "chunk_size",
        "sub_chunk_size",
        "segment_len",
        "conv_size",
    ):
        if getattr(m, key) <= 0:
            bad(key, f"must be > 0, got {getattr(m, key)}")
    for key in ("expand_k", "expand_v", "gate_logit_normalizer", "norm_eps", "init_std"):
        if not getattr(m, key) > 0:
            bad(key, f"must be > 0, got {getattr(m, key)}")
    if m.gate_clamp_min is not None and not (math.isfinite(m.gate_clamp_min) and m.gate_clamp_min <= 0):
        bad("gate_clamp_min", f"must be a finite number <= 0 or null (no clamp), got {m.gate_clamp_min}")
    if m.mlp_hidden < 0:
        bad("mlp_hidden", f"must be >= 0 (0 = automatic), got {m.mlp_hidden}")
    if m.key_dim % m.n_heads or m.key_dim == 0:
        bad("n_heads", f"key dim d_model*expand_k={m.key_dim} is not divisible by n_heads={m.n_heads}")
    if m.value_dim % m.n_heads or m.value_dim == 0:
        bad("n_heads", f"value dim d_model*expand_v={m.value_dim} is not divisible by n_heads={m.n_heads}")
    if m.chunk_size % m.sub_chunk_size:
        bad("sub_chunk_size", f"{m.sub_chunk_size} does not divide chunk_size={m.chunk_size}")
    if m.sub_chunk_size > 32:
        bad(
            "sub_chunk_size",
            f"must be <= 32, got {m.sub_chunk_size}: the gate floor that keeps the "
            "chunked form exact, -80/(sub/2) per token, would cut real decays",
        )
    if m.conv_size < 2 and m.use_short_conv:
        bad("conv_size", "must be >= 2 when use_short_conv is true")
    if m.kernel not in KERNELS:
        bad("kernel", f"must be one of {', '.join(KERNELS)}, got {m.kernel!r}")
    if m.dtype not in MODEL_DTYPES:
        bad("dtype", f"must be one of {', '.join(MODEL_DTYPES)}, got {m.dtype!r}")
    return m


def preset_model_config(name: str, **overrides) -> ModelConfig:
    """The named preset, with optional field overrides, validated."""
    if name not in PRESETS:
        raise ConfigError(f"model.preset: unknown preset {name!r} (choose from {', '.join(PRESETS)})")
    values = dict(PRESETS[name])
    values.update({k: v for k, v in overrides.items() if v is not None})
    return validate_model_config(ModelConfig(**values))


def architecture_family(cfg: ModelConfig) -> str:
    """gla (no softmax attention layer), softmax (every layer attention) or hybrid (some of each)."""
    attn = len(cfg.attn_layers)
    return "gla" if attn == 0 else "softmax" if attn == cfg.n_layers else "hybrid"
