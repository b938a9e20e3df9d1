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

# fla 0.6's AttentionSpec defaults (fla/models/configuration_utils.py, parse_attention_config)
ATTN_DEFAULTS = {"qkv_bias": False, "window_size": None, "rope_theta": 10000.0}
# fla 0.6's GatedDeltaNetConfig defaults for what a Gated DeltaNet layer is (laplace.model.gated_deltanet)
GDN_DEFAULTS = {"num_heads": 6, "head_dim": 256, "num_v_heads": None, "expand_v": 2.0, "allow_neg_eigval": False}
# Laplace's init-only Gated DeltaNet knob (no fla config field): the range dt is drawn from, log-uniformly, to
# initialise dt_bias. The default is fla's (Mamba2's) [1e-3, 0.1]; [1e-4, 1e-3] starts every decay near 1 (long
# memory, as GLA's gate_bias_init does). Kept out of a spec's normal form at its default, so the
# architectures, exports and fingerprints of models that never set it are unchanged.
GDN_DT_INIT_DEFAULT = [1e-3, 0.1]


def _doc(default=dataclasses.MISSING, doc: str = ""):
    """A field with its one-line doc: laplace.config makes every field a `model:` knob documented by it."""
    return dataclasses.field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a GLA language model, or a Gated DeltaNet / hybrid / softmax one (fla conventions)."""

    vocab_size: int = _doc(doc="empty: the preset's, else the tokenizer's")
    d_model: int = _doc(doc="hidden size")
    n_layers: int = _doc(doc="blocks: GLA, or softmax attention where `attn` names them")
    n_heads: int = _doc(doc="GLA heads; d_model * expand_k and d_model * expand_v divide by it")
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
    attn: Any = _doc(
        None,
        "softmax attention layers, fla's AttentionSpec: {layers: [i, ...], num_heads: H, num_kv_heads: H, "
        "qkv_bias: false, window_size: null, rope_theta: 10000.0} or a list of them; null: every layer GLA",
    )
    gdn: Any = _doc(
        None,
        "Gated DeltaNet layers (fla's gated_deltanet): {layers: [i, ...], num_heads: 6, head_dim: 256, "
        "num_v_heads: null (= num_heads; more: GVA), expand_v: 2.0, allow_neg_eigval: false, dt_init_range: [0.001, "
        "0.1] (dt_bias's init: dt log-uniform in this range, fla's; [0.0001, 0.001] starts the decays near 1, long "
        "memory)}; they share use_short_conv, conv_size, norm_eps, chunk_size and segment_len; null: none",
    )
    # How the GLA core runs, not what the model is (laplace.model.kernels). Left out of exports
    # and of the training run's fingerprint.
    kernel: str = _doc(
        "auto",
        "the GLA and Gated DeltaNet cores: torch (plain PyTorch, any device) | fla (flash-linear-attention's "
        "Triton kernels: CUDA, pip install 'laplace[cuda]') | auto (fla on CUDA when installed, else torch)",
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

    @property
    def attn_specs(self) -> list[dict]:
        """The attention specs, normalised as fla's parse_attention_config leaves them (a list)."""
        parsed = parse_attention_config(self.attn, self.n_layers)
        return [] if parsed is None else [parsed] if isinstance(parsed, dict) else parsed

    def attention_spec(self, layer: int) -> dict | None:
        """The spec of layer `layer` if it is a softmax attention layer, else None (a GLA layer)."""
        return next((s for s in self.attn_specs if layer in s["layers"]), None)

    @property
    def attn_layers(self) -> tuple[int, ...]:
        return tuple(sorted(i for s in self.attn_specs for i in s["layers"]))

    @property
    def gdn_spec(self) -> dict | None:
        """The Gated DeltaNet spec with fla's defaults filled in, or None."""
        return None if self.gdn is None else {**GDN_DEFAULTS, "dt_init_range": GDN_DT_INIT_DEFAULT, **self.gdn}

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return () if self.gdn is None else tuple(sorted(self.gdn["layers"]))

    @property
    def gla_layers(self) -> tuple[int, ...]:
        other = set(self.attn_layers) | set(self.gdn_layers)
        return tuple(i for i in range(self.n_layers) if i not in other)

    def gdn_dims(self) -> dict[str, int]:
        """Gated DeltaNet sizes: H (query/key heads), HV (value heads), Kh, Vh (per head), K, V (total)."""
        spec = self.gdn_spec
        H, Kh = spec["num_heads"], spec["head_dim"]
        HV = spec["num_v_heads"] or H
        Vh = int(Kh * spec["expand_v"])
        return {"H": H, "HV": HV, "Kh": Kh, "Vh": Vh, "K": H * Kh, "V": HV * Vh}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def architecture(self) -> dict:
        """Every field that decides the weights and the function they compute (not `kernel`; not
        `gdn` when null, so models and runs from before it existed keep their fingerprints)."""
        return {k: v for k, v in self.to_dict().items() if k not in RUNTIME_FIELDS and not (k == "gdn" and v is None)}


def attn_every(n_layers: int, every: int, num_heads: int, **spec) -> dict:
    """An AttentionSpec putting softmax attention in the last layer of every `every` (1: all layers):
    the m-a-p hybrids' N:1 pattern (arXiv 2507.06457) has one attention layer per N-1 GLA layers."""
    return {"layers": list(range(every - 1, n_layers, every)), "num_heads": num_heads, **spec}


_TINY = dict(vocab_size=0, d_model=256, n_layers=4, n_heads=4, chunk_size=64)
# Gated DeltaNet at GLA's key and value widths (tiny: K = 128, V = 256; 3B: K = 1536, V = 3072)
_TINY_GDN = {"num_heads": 2, "head_dim": 64, "expand_v": 2.0}
_3B_GDN = {"num_heads": 6, "head_dim": 256, "expand_v": 2.0}
_SMALL = dict(vocab_size=0, d_model=768, n_layers=12, n_heads=6, chunk_size=64)
_3B = dict(vocab_size=50304, d_model=3072, n_layers=24, n_heads=16, chunk_size=128, dtype="bfloat16")

PRESETS: dict[str, dict[str, Any]] = {
    # ~5.5M parameters with a 4k vocabulary: trains in minutes on 2 CPU cores.
    "tiny": _TINY,
    # ~110M parameters with a 16k vocabulary (GPT-2 small shape): benchmarks.
    "small": _SMALL,
    # Laplace 3B: 24 layers, hidden 3072; see README "Reproducing the 3B figures".
    "laplace-3b": _3B,
    # Softmax baselines (every layer attention) and hybrids (one attention layer in N) of the same
    # shapes: issue 32's side-by-side comparison takes them as they are.
    "tiny-attn": {**_TINY, "attn": attn_every(4, 1, num_heads=4)},
    "tiny-hybrid": {**_TINY, "attn": attn_every(4, 4, num_heads=4)},  # layer 3 of 0..3: 3 GLA, 1 attention
    "small-attn": {**_SMALL, "attn": attn_every(12, 1, num_heads=12)},
    "small-hybrid": {**_SMALL, "attn": attn_every(12, 4, num_heads=12)},  # 3:1
    "laplace-3b-attn": {**_3B, "attn": attn_every(24, 1, num_heads=24, num_kv_heads=8)},
    "laplace-3b-hybrid-3to1": {**_3B, "attn": attn_every(24, 4, num_heads=24, num_kv_heads=8)},
    "laplace-3b-hybrid-7to1": {**_3B, "attn": attn_every(24, 8, num_heads=24, num_kv_heads=8)},
    # one attention layer (the last) beside 23 GLA layers: the m-a-p 24:1 ratio in 24 layers
    "laplace-3b-hybrid-24to1": {**_3B, "attn": attn_every(24, 24, num_heads=24, num_kv_heads=8)},
    # Gated DeltaNet (issue 44): every layer, or beside one attention layer in four / eight
    "tiny-gdn": {**_TINY, "gdn": {"layers": list(range(4)), **_TINY_GDN}},
    "tiny-gdn-hybrid": {**_TINY, "attn": attn_every(4, 4, num_heads=4), "gdn": {"layers": [0, 1, 2], **_TINY_GDN}},
    "laplace-3b-gdn": {**_3B, "gdn": {"layers": list(range(24)), **_3B_GDN}},
    "laplace-3b-gdn-hybrid-7to1": {
        **_3B,
        "attn": attn_every(24, 8, num_heads=24, num_kv_heads=8),
        "gdn": {"layers": [i for i in range(24) if i % 8 != 7], **_3B_GDN},
    },
}

MODEL_DTYPES = ("float32", "bfloat16", "float16", "float64")
KERNELS = ("auto", "torch", "fla")  # laplace.model.kernels
RUNTIME_FIELDS = ("kernel",)


class AttentionSpecError(ConfigError):
    """An `attn` spec fla 0.6 would refuse (its message, word for word), or Laplace cannot build."""


def parse_attention_config(attn: Any, num_hidden_layers: int) -> dict | list[dict] | None:
    """fla 0.6's parse_attention_config (fla/models/configuration_utils.py), transcribed so the knob
    is checked where fla is not installed: the same defaults, the same refusals in the same words,
    dict or list form kept, unknown keys kept, the input not modified."""
    if attn is None:
        return None
    if isinstance(num_hidden_layers, bool) or not isinstance(num_hidden_layers, int) or num_hidden_layers < 0:
        raise AttentionSpecError(f"field 'num_hidden_layers' must be a non-negative integer; got {num_hidden_layers!r}")
    if not isinstance(attn, (dict, list, tuple)):
        raise AttentionSpecError(f"attn must be None, a dictionary, or a list of dictionaries; got {attn!r}")
    configs, assigned = [], {}
    for i, config in enumerate([attn] if isinstance(attn, dict) else attn):
        context = "attn specification" if isinstance(attn, dict) else f"attn specification at index {i}"
        if not isinstance(config, dict):
            raise AttentionSpecError(f"{context} must be a dictionary; got {config!r}")
        config = dict(config)
        for name in ("layers", "num_heads"):
            if name not in config:
                raise AttentionSpecError(f"{context} field {name!r} is required; got <missing>")
        layers = config["layers"]
        if not isinstance(layers, (list, tuple)):
            raise AttentionSpecError(
                f"{context} field 'layers' must be a list or tuple of integer layer indices; got {layers!r}"
            )
        for layer in layers:
            if isinstance(layer, bool) or not isinstance(layer, int):
                raise AttentionSpecError(
                    f"{context} field 'layers' must contain only integer layer indices; got {layer!r}"
                )
            if layer < 0 or layer >= num_hidden_layers:
                raise AttentionSpecError(
                    f"{context} field 'layers' contains out-of-range layer {layer!r}; "
                    f"expected a value in [0, {num_hidden_layers})"
                )
            if layer in assigned:
                if assigned[layer] == i:
                    raise AttentionSpecError(
                        f"{context} field 'layers' contains duplicate layer {layer!r}; got {layers!r}"
                    )
                raise AttentionSpecError(
                    f"{context} assigns conflicting layer {layer!r}, "
                    f"which is already assigned by attn specification at index {assigned[layer]}"
                )
            assigned[layer] = i
        config["layers"] = list(layers)
        if config.get("num_kv_heads") is None:
            config["num_kv_heads"] = config["num_heads"]
        for name in ("num_heads", "num_kv_heads"):
            value = config[name]
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise AttentionSpecError(f"{context} field {name!r} must be a positive integer; got {value!r}")
        qkv_bias = config.setdefault("qkv_bias", ATTN_DEFAULTS["qkv_bias"])
        if not isinstance(qkv_bias, bool):
            raise AttentionSpecError(f"{context} field 'qkv_bias' must be a Boolean; got {qkv_bias!r}")
        window = config.setdefault("window_size", ATTN_DEFAULTS["window_size"])
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
            raise AttentionSpecError(f"{context} field 'window_size' must be a positive integer; got {window!r}")
        theta = config.setdefault("rope_theta", ATTN_DEFAULTS["rope_theta"])
        try:
            valid = (
                not isinstance(theta, bool) and isinstance(theta, (int, float)) and math.isfinite(theta) and theta > 0
            )
        except OverflowError:
            valid = False
        if not valid:
            raise AttentionSpecError(f"{context} field 'rope_theta' must be positive and finite; got {theta!r}")
        configs.append(config)
    return configs[0] if isinstance(attn, dict) else configs


def _check_attention(m: ModelConfig, prefix: str) -> None:
    """fla's refusals (parse_attention_config), then what its Attention asserts or silently floors:
    heads that divide the hidden size and kv heads that divide the heads, an even head dim (RoPE),
    and no key Laplace would ignore."""
    try:
        specs = m.attn_specs
    except AttentionSpecError as exc:
        raise AttentionSpecError(f"{prefix}.attn: {exc}") from None
    known = {"layers", "num_heads", "num_kv_heads", *ATTN_DEFAULTS}
    for i, spec in enumerate(specs):
        where = f"{prefix}.attn" if isinstance(m.attn, dict) else f"{prefix}.attn[{i}]"
        unknown = sorted(set(spec) - known)
        if unknown:
            raise AttentionSpecError(f"{where}.{unknown[0]}: not an AttentionSpec field Laplace implements")
        h, kv = spec["num_heads"], spec["num_kv_heads"]
        if m.d_model % h:
            raise AttentionSpecError(f"{where}.num_heads: {h} does not divide d_model={m.d_model}")
        if h % kv:
            raise AttentionSpecError(f"{where}.num_kv_heads: {kv} does not divide num_heads={h}")
        if (m.d_model // h) % 2:
            raise AttentionSpecError(
                f"{where}.num_heads: head dim d_model/num_heads={m.d_model // h} must be even (RoPE)"
            )


def _check_gdn(m: ModelConfig, prefix: str) -> None:
    """What fla's GatedDeltaNet refuses or asserts, one line naming the key; and no layer both
    attention and Gated DeltaNet."""
    if m.gdn is None:
        return
    where = f"{prefix}.gdn"
    if not isinstance(m.gdn, dict):
        raise ConfigError(f"{where}: must be a mapping {{layers: [...], num_heads: ..}} or null, got {m.gdn!r}")
    unknown = sorted(set(m.gdn) - {"layers", "dt_init_range", *GDN_DEFAULTS})
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: not a Gated DeltaNet field Laplace implements")
    layers = m.gdn.get("layers")
    if not isinstance(layers, (list, tuple)) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < m.n_layers for i in layers
    ):
        raise ConfigError(f"{where}.layers: a list of layer indices in [0, {m.n_layers}), got {layers!r}")
    if len(set(layers)) != len(layers):
        raise ConfigError(f"{where}.layers: duplicate layer in {layers!r}")
    both = sorted(set(layers) & set(m.attn_layers))
    if both:
        raise ConfigError(f"{where}.layers: layer {both[0]} is also an attention layer (model.attn)")
    spec = m.gdn_spec
    for key in ("num_heads", "head_dim") + (("num_v_heads",) if spec["num_v_heads"] is not None else ()):
        value = spec[key]
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{where}.{key}: must be a positive integer, got {value!r}")
    expand = spec["expand_v"]
    if isinstance(expand, bool) or not isinstance(expand, (int, float)) or not expand > 0:
        raise ConfigError(f"{where}.expand_v: must be > 0, got {expand!r}")
    if not float(spec["head_dim"] * expand).is_integer():
        raise ConfigError(f"{where}.expand_v: head_dim * expand_v = {spec['head_dim'] * expand} is not an integer")
    H, HV = spec["num_heads"], spec["num_v_heads"] or spec["num_heads"]
    if HV % H:
        raise ConfigError(f"{where}.num_v_heads: {HV} is not a multiple of num_heads={H} (GVA)")
    if not isinstance(spec["allow_neg_eigval"], bool):
        raise ConfigError(f"{where}.allow_neg_eigval: must be a Boolean, got {spec['allow_neg_eigval']!r}")
    dt = spec["dt_init_range"]
    if (
        not isinstance(dt, (list, tuple))
        or len(dt) != 2
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in dt)
        or not 0 < dt[0] <= dt[1]
    ):
        raise ConfigError(f"{where}.dt_init_range: must be [low, high] with 0 < low <= high, got {dt!r}")


def _gdn_normal_form(m: ModelConfig) -> dict:
    """The Gated DeltaNet spec with fla's defaults filled in; dt_init_range only where it is not the default."""
    spec = {**GDN_DEFAULTS, **m.gdn, "layers": list(m.gdn["layers"])}
    dt = [float(v) for v in spec.pop("dt_init_range", GDN_DT_INIT_DEFAULT)]
    return spec if dt == GDN_DT_INIT_DEFAULT else {**spec, "dt_init_range": dt}


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
    _check_attention(m, prefix)
    _check_gdn(m, prefix)
    if m.gla_layers:  # the GLA sizes matter only where there is a GLA layer (not in an fla GDN import)
        if m.key_dim % m.n_heads or m.key_dim == 0:
            bad("n_heads", f"key dim d_model*expand_k={m.key_dim} is not divisible by n_heads={m.n_heads}")
        if m.value_dim % m.n_heads or m.value_dim == 0:
            bad("n_heads", f"value dim d_model*expand_v={m.value_dim} is not divisible by n_heads={m.n_heads}")
    if m.attn is not None:  # fla's normal form (defaults filled, lists): exports and fingerprints agree
        m = dataclasses.replace(m, attn=parse_attention_config(m.attn, m.n_layers))
    if m.gdn is not None:  # the same for the Gated DeltaNet spec
        m = dataclasses.replace(m, gdn=_gdn_normal_form(m))
    return m


def preset_model_config(name: str, **overrides) -> ModelConfig:
    """The named preset, with optional field overrides, validated."""
    if name not in PRESETS:
        raise ConfigError(f"model.preset: unknown preset {name!r} (choose from {', '.join(PRESETS)})")
    values = dict(PRESETS[name])
    values.update({k: v for k, v in overrides.items() if v is not None})
    return validate_model_config(ModelConfig(**values))


def architecture_family(cfg: ModelConfig) -> str:
    """gla (every layer GLA), gated_deltanet (every layer Gated DeltaNet), softmax (every layer
    attention) or hybrid (more than one kind)."""
    counts = {"gla": len(cfg.gla_layers), "gated_deltanet": len(cfg.gdn_layers), "softmax": len(cfg.attn_layers)}
    kinds = [name for name, n in counts.items() if n]
    return kinds[0] if len(kinds) == 1 else "hybrid"
