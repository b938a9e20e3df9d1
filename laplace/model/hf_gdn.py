"""fla's `gated_deltanet` checkpoints (GatedDeltaNetForCausalLM, with or without `attn` layers) in
and out: config.json mapped key by key onto `model.gdn`, as laplace.model.hf maps GLA's.

The weights need no rules of their own: fla's names are Laplace's under `model.layers.{i}.attn.`
(q/k/v/a/b/g/o projections, A_log, dt_bias, o_norm) but for the convolutions (`q_conv1d` for
`q_conv`), which laplace.model.hf renames for GLA already. A Laplace model that mixes GLA and Gated
DeltaNet layers has no fla model type and is refused on export."""

from __future__ import annotations

import json
import math

from laplace.errors import InputError, one_line
from laplace.model.config import GDN_DEFAULTS, ModelConfig, validate_model_config
from laplace.model.hf_fields import (
    COMMON_MAPPED_FIELDS,
    DTYPE_NAMES,
    NEUTRAL_FIELDS,
    TRANSFORMERS_COMMON_KEYS,
    HFFormatError,
    common_to_hf,
    fla_intermediate_size,
    refuse,
    split_attention,
    token_id,
)

MODEL_TYPE = "gated_deltanet"
# GatedDeltaNetConfig's defaults (fla 0.6) for the keys a hand-written config.json may leave out
FLA_GDN_DEFAULTS = {
    "hidden_size": 2048,
    "num_hidden_layers": 21,
    "vocab_size": 32000,
    "use_short_conv": True,
    "conv_size": 4,
    "norm_eps": 1e-6,
    **GDN_DEFAULTS,
}
# field -> the values Laplace implements (anything else changes the function)
REQUIRED_VALUES = {
    "model_type": (MODEL_TYPE,),
    "use_gate": (True,),  # without it fla's output norm has no gate
    "hidden_act": ("swish", "silu"),
    "output_gate_activation": ("swish", "silu"),  # sigmoid: another gate
    "attnres_block_size": (None,),
    "attn_mode": ("chunk", "fused_recurrent"),  # two kernels of one function
    "pruned_heads": ({},),
}
MAPPED_FIELDS = COMMON_MAPPED_FIELDS | {"num_v_heads", "head_dim", "allow_neg_eigval"}
# ModelConfig fields of GLA layers only: an fla gated_deltanet config.json has no place for them
GLA_ONLY_FIELDS = (
    "n_heads",
    "expand_k",
    "expand_v",
    "gate_low_rank_dim",
    "gate_logit_normalizer",
    "gate_clamp_min",
    "gate_bias_init",
    "sub_chunk_size",
)


def known_keys() -> set[str]:
    """Every gated_deltanet config.json key the importer has a rule for; any other is refused by name."""
    return NEUTRAL_FIELDS | TRANSFORMERS_COMMON_KEYS | set(REQUIRED_VALUES) | MAPPED_FIELDS | {"attn"}


def config_from_hf(hf: dict, where: str = "config.json") -> tuple[ModelConfig, int | None, int | None]:
    """(ModelConfig, bos id, eos id) from an fla gated_deltanet config.json: every layer not in `attn`
    Gated DeltaNet; a one-line HFFormatError naming the first field Laplace does not support."""
    hf, attn = split_attention(hf, where)
    _check_supported(hf, where)
    get = {**FLA_GDN_DEFAULTS, **hf}.get
    d, layers = get("hidden_size"), get("num_hidden_layers")
    attn_layers = (
        set() if attn is None else {i for spec in ([attn] if isinstance(attn, dict) else attn) for i in spec["layers"]}
    )
    intermediate = hf.get("intermediate_size") or fla_intermediate_size(d, hf.get("hidden_ratio", 4))
    dtype = hf.get("dtype", hf.get("torch_dtype")) or "float32"
    if dtype not in DTYPE_NAMES:
        refuse(
            hf,
            where,
            "dtype" if "dtype" in hf else "torch_dtype",
            f"is not a dtype Laplace serves in ({', '.join(DTYPE_NAMES)})",
        )
    gdn = {
        "layers": [i for i in range(layers) if i not in attn_layers],
        "num_heads": get("num_heads"),
        "head_dim": get("head_dim"),
        "num_v_heads": hf.get("num_v_heads"),
        "expand_v": float(get("expand_v")),
        "allow_neg_eigval": get("allow_neg_eigval"),
    }
    try:
        cfg = validate_model_config(
            ModelConfig(
                vocab_size=get("vocab_size"),
                d_model=d,
                n_layers=layers,
                n_heads=get("num_heads"),  # no GLA layer: unused
                mlp_hidden=int(intermediate),
                use_short_conv=bool(get("use_short_conv")),
                conv_size=int(get("conv_size")),
                norm_eps=float(get("norm_eps")),
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                init_std=float(hf.get("initializer_range", 0.02)),
                dtype=DTYPE_NAMES[dtype],
                attn=attn,
                gdn=gdn,
            ),
            prefix=where,
        )
    except InputError as exc:
        raise HFFormatError(str(exc)) from None
    except (TypeError, ValueError) as exc:
        raise HFFormatError(f"{where}: {one_line(exc)}") from exc
    return cfg, token_id(hf, "bos_token_id", where), token_id(hf, "eos_token_id", where)


def _check_supported(hf: dict, where: str) -> None:
    """Refuse, by name and value, the first field Laplace does not implement or does not know, then
    what fla's GatedDeltaNet refuses (sizes, GVA heads, a value head size that is not an integer)."""
    for field, allowed in REQUIRED_VALUES.items():
        if hf.get(field, allowed[0]) not in allowed:
            why = f"is not supported by Laplace (supported: {', '.join(json.dumps(a) for a in allowed)})"
            refuse(hf, where, field, why)
    unknown = sorted(set(hf) - known_keys())
    if unknown:
        why = "is a field Laplace does not know, so cannot promise to compute the same function"
        refuse(hf, where, unknown[0], why)
    for field in ("hidden_size", "num_hidden_layers", "num_heads", "head_dim", "vocab_size", "conv_size"):
        value = hf.get(field, FLA_GDN_DEFAULTS.get(field))
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            refuse(hf, where, field, "must be a positive integer")
    heads, v_heads = hf.get("num_heads", 6), hf.get("num_v_heads")
    if v_heads is not None and (isinstance(v_heads, bool) or not isinstance(v_heads, int) or v_heads % heads):
        refuse(hf, where, "num_v_heads", f"must be a positive multiple of num_heads={heads} (GVA) or null")
    expand = hf.get("expand_v", 2.0)
    head_dim = hf.get("head_dim", 256)
    if (
        isinstance(expand, bool)
        or not isinstance(expand, (int, float))
        or expand <= 0
        or not math.isclose(head_dim * expand, round(head_dim * expand))
    ):
        refuse(hf, where, "expand_v", f"must make head_dim*expand_v (head_dim={head_dim}) a positive integer")
    if not isinstance(hf.get("allow_neg_eigval", False), bool):
        refuse(hf, where, "allow_neg_eigval", "must be a Boolean")


def config_to_hf(cfg: ModelConfig, bos_id: int | None, eos_id: int | None) -> dict:
    """fla's GatedDeltaNetConfig fields for a Laplace architecture whose layers are all Gated DeltaNet
    or attention; HFFormatError for a GLA + GDN mix, which no fla model holds."""
    if cfg.gla_layers:
        raise HFFormatError(
            f"model.gdn: layers {list(cfg.gla_layers)} are GLA; fla's gated_deltanet model holds Gated "
            "DeltaNet and attention layers only, so an HF export cannot carry this mix"
        )
    spec = cfg.gdn_spec
    return {
        "architectures": ["GatedDeltaNetForCausalLM"],
        "model_type": MODEL_TYPE,
        "attn_mode": "chunk",
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_heads": spec["num_heads"],
        "num_v_heads": spec["num_v_heads"],
        "head_dim": spec["head_dim"],
        "expand_v": spec["expand_v"],
        "allow_neg_eigval": spec["allow_neg_eigval"],
        "use_gate": True,
        "output_gate_activation": "swish",
        "use_short_conv": cfg.use_short_conv,
        "conv_size": cfg.conv_size,
        "hidden_ratio": 4,
        "intermediate_size": cfg.ffn_dim,
        "hidden_act": "swish",
        "norm_eps": cfg.norm_eps,
        "attn": cfg.attn,
        **common_to_hf(cfg, bos_id, eos_id),
    }
