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


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a GLA language model (fla conventions)."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    expand_k: float = 0.5
    expand_v: float = 1.0
    mlp_hidden: int = 0  # 0: fla's rule, 4 * d * 2/3 rounded up to a multiple of 256
    gate_low_rank_dim: int = 16
    gate_logit_normalizer: float = 16.0
    # Floor of the per-channel log decay, fla's `clamp_min` (None: no clamp, fla's default). Laplace's
    # models clamp at -10, where the torch chunked form is exact (laplace.model.gla.min_log_decay).
    gate_clamp_min: float | None = -10.0
    gate_bias_init: float = 0.0  # > 0 starts the forget gates near 1 (long memory)
    use_short_conv: bool = True
    conv_size: int = 4
    norm_eps: float = 1e-6
    chunk_size: int = 64
    sub_chunk_size: int = 16
    segment_len: int = 2048  # long sequences run in segments of this many tokens carrying the state
    tie_embeddings: bool = False
    init_std: float = 0.02
    dtype: str = "float32"  # dtype the model is served in (parameters, activations, conv cache)
    # How the GLA core runs, not what the model is (laplace.model.kernels): auto | torch | fla.
    # Left out of exports and of the training run's fingerprint.
    kernel: str = "auto"

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
