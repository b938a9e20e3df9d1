"""The Hugging Face / flash-linear-attention layout of a GLA checkpoint, beside Laplace's export
(Gated DeltaNet ones, `model_type: gated_deltanet`, through laplace.model.hf_gdn).

Every checkpoint of the field enters and leaves through here:

- `import_checkpoint(src, out_dir)`: a directory in fla's layout (config.json with
  `model_type: gla`, model.safetensors or a sharded model.safetensors.index.json, tokenizer.json),
  or a hub id resolved with huggingface_hub, -> a Laplace export (laplace.model.export).
- `export_hf(export_dir, out_dir)`: a Laplace export -> a directory that
  `transformers.AutoModelForCausalLM.from_pretrained(dir)` loads after `import fla`, strictly.

Laplace's GLA language model and fla 0.6's GLAForCausalLM compute the same function, and the
weights map one to one by renaming (`NAME_MAP`), so both directions move tensors bit for bit
(no dtype change). config.json is mapped key by key (`config_from_hf`) to what fla 0.6 itself
computes with it: a key Laplace does not implement (a feature map, no output gate, grouped key heads
of the GLA layers ...) is refused by name and value; a key fla stores but never reads
(`FLA_IGNORES`: gate_logit_normalizer, use_gk, ...) is not obeyed either, since fla does not, and
the import names it. A hybrid's `attn` (fla's AttentionSpec: softmax attention layers, weights
model.layers.{i}.attn.{q,k,v,o}_proj) maps onto model.attn. An HF export carries the Laplace
export's own config under the `laplace` key, so a Laplace export that goes out and comes back in is
byte-identical.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from laplace.errors import InputError, one_line
from laplace.fileio import atomic_write_json, replace_dir, staging_dir
from laplace.model import hf_gdn
from laplace.model.config import ModelConfig, validate_model_config
from laplace.model.export import FORMAT, load_export_tensors, write_export
from laplace.model.hf_fields import (
    COMMON_MAPPED_FIELDS,
    DTYPE_NAMES,
    NEUTRAL_FIELDS,
    TRANSFORMERS_COMMON_KEYS,
    HFFormatError,
    common_to_hf,
    fla_intermediate_size,
)
from laplace.model.hf_fields import refuse as _refuse
from laplace.model.hf_fields import split_attention as _split_attention
from laplace.model.hf_fields import token_id as _token_id
from laplace.model.lm import LaplaceLM
from laplace.tokenizer_file import load_tokenizer, tokenizer_sha256

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER = "tokenizer.json"
# fla fixes these in its GLA layer (GatedLinearAttention's defaults; GLAConfig has no field for them)
FLA_GATE_LOW_RANK_DIM = 16
FLA_GATE_LOGIT_NORMALIZER = 16
FLA_ATTN_MODES = ("chunk", "fused_recurrent", "fused_chunk")  # three kernels of one function
FLA_NORM_EPS = 1e-6  # GLAConfig's default norm_eps


# --------------------------------------------------------------------------- names

# (Laplace pattern, fla replacement) and back; fla names its unfused norm (fuse_norm: false) g_norm
TO_FLA = [
    (r"^embed\.weight$", "model.embeddings.weight"),
    (r"^norm\.weight$", "model.norm.weight"),
    (r"^lm_head\.weight$", "lm_head.weight"),
    (r"^blocks\.(\d+)\.attn\.(q|k|v)_conv\.weight$", r"model.layers.\1.attn.\2_conv1d.weight"),
    (r"^blocks\.(\d+)\.attn\.g_norm\.weight$", r"model.layers.\1.attn.g_norm_swish_gate.weight"),
    (r"^blocks\.(\d+)\.(.+)$", r"model.layers.\1.\2"),
]
FROM_FLA = [
    (r"^model\.embeddings\.weight$", "embed.weight"),
    (r"^model\.norm\.weight$", "norm.weight"),
    (r"^lm_head\.weight$", "lm_head.weight"),
    (r"^model\.layers\.(\d+)\.attn\.(q|k|v)_conv1d\.weight$", r"blocks.\1.attn.\2_conv.weight"),
    (r"^model\.layers\.(\d+)\.attn\.g_norm(_swish_gate)?\.weight$", r"blocks.\1.attn.g_norm.weight"),
    (r"^model\.layers\.(\d+)\.(.+)$", r"blocks.\1.\2"),
]


def _rename(name: str, rules) -> str | None:
    for pattern, replacement in rules:
        if re.match(pattern, name):
            return re.sub(pattern, replacement, name)
    return None


def to_fla_name(name: str) -> str:
    out = _rename(name, TO_FLA)
    if out is None:
        raise HFFormatError(f"no fla name for the Laplace tensor {name!r}")
    return out


def from_fla_name(name: str) -> str:
    """Laplace's name of an fla tensor (unknown names come out unchanged, for the caller to refuse)."""
    return _rename(name, FROM_FLA) or name


# --------------------------------------------------------------------------- config.json

# keys GLAConfig stores (or keeps as extra keys, PreTrainedConfig style) that no fla 0.6 layer reads:
# GLABlock never passes them to GatedLinearAttention, which computes with the value given here
# whatever config.json says. Laplace computes what fla computes, and the import names each one that
# claims another value (`keys_fla_ignores`): obeying the key would give another function than fla's.
FLA_IGNORES = {
    "gate_logit_normalizer": FLA_GATE_LOGIT_NORMALIZER,
    "use_gk": True,
    "use_gv": False,
    "conv_bias": False,
}
# keys fla ignores too, but whose other values cannot describe the weights fla loads (a gate
# projection of another rank): refused by name rather than left to a tensor shape
FLA_FIXED = {"gate_low_rank_dim": FLA_GATE_LOW_RANK_DIM}
# field -> the values Laplace implements (anything else changes the function)
REQUIRED_VALUES = {
    "model_type": ("gla",),
    "feature_map": (None,),
    "use_output_gate": (True,),
    "hidden_act": ("swish", "silu"),
    "elementwise_affine": (True,),  # false or null: fla's norms have no weight
    "attn": (None,),
    "attnres_block_size": (None,),
    "attn_mode": FLA_ATTN_MODES,
    "pruned_heads": ({},),
}
# fields of earlier fla releases that fla 0.6 no longer reads, and the public fla-hub checkpoints
# (gla-1.3B-100B, gla-2.7B-100B) still carry: accepted only where fla 0.6 computes the same with them
LEGACY_FIELDS = {"rms_norm_eps", "share_conv_kernel"}
MAPPED_FIELDS = COMMON_MAPPED_FIELDS | {"num_kv_heads", "expand_k", "clamp_min"}


def config_from_hf(hf: dict, where: str = "config.json") -> tuple[ModelConfig, int | None, int | None]:
    """(ModelConfig, bos id, eos id) from an fla GLA config.json; one-line HFFormatError naming the
    first field (and value) Laplace does not support."""
    if hf.get("model_type") == hf_gdn.MODEL_TYPE:
        return hf_gdn.config_from_hf(hf, where)
    hf, attn = _split_attention(hf, where)
    _check_supported(hf, where)
    cfg = _with_attention(_gla_model_config(hf, where), attn, where)
    return cfg, _token_id(hf, "bos_token_id", where), _token_id(hf, "eos_token_id", where)


def _check_supported(hf: dict, where: str) -> None:
    """Refuse, by name, the first field that is not a GLA's, that Laplace does not implement, that
    fla 0.6 does not build as written, or that Laplace does not know; then the sizes (positive)."""
    if hf.get("model_type") != "gla":
        _refuse(
            hf,
            where,
            "model_type",
            "is not a GLA checkpoint (expected model_type: gla, or gated_deltanet for Gated DeltaNet)",
        )
    for field, allowed in REQUIRED_VALUES.items():
        if hf.get(field, allowed[0]) not in allowed:
            why = f"is not supported by Laplace (supported: {', '.join(json.dumps(a) for a in allowed)})"
            _refuse(hf, where, field, why)
    for field, fixed in FLA_FIXED.items():
        if hf.get(field, fixed) != fixed:
            why = f"is not what fla 0.6 builds (it reads no {field} and fixes it at {fixed}); Laplace refuses it"
            _refuse(hf, where, field, why)
    unknown = sorted(set(hf) - known_keys())
    if unknown:
        _refuse(
            hf, where, unknown[0], "is a field Laplace does not know, so cannot promise to compute the same function"
        )
    norm_eps = hf.get("norm_eps", FLA_NORM_EPS)
    if "rms_norm_eps" in hf and not (
        isinstance(hf["rms_norm_eps"], (int, float)) and math.isclose(hf["rms_norm_eps"], norm_eps, rel_tol=1e-9)
    ):
        why = f"disagrees with norm_eps={norm_eps}, the epsilon fla 0.6 computes with (it reads no other)"
        _refuse(hf, where, "rms_norm_eps", why)
    if hf.get("use_short_conv") and hf.get("share_conv_kernel"):
        why = "is a short convolution shared by q/k/v (earlier fla); fla 0.6 and Laplace have one each"
        _refuse(hf, where, "share_conv_kernel", why)
    for field in ("hidden_size", "num_hidden_layers", "num_heads", "vocab_size"):
        if not isinstance(hf.get(field), int) or hf[field] <= 0:
            _refuse(hf, where, field, "must be a positive integer")
    heads = hf["num_heads"]
    if hf.get("num_kv_heads") not in (None, heads):
        _refuse(
            hf, where, "num_kv_heads", f"is not supported by Laplace (grouped key/value heads; only null or {heads})"
        )


def _gla_model_config(hf: dict, where: str) -> ModelConfig:
    """The GLA layers' ModelConfig from the supported fields (_check_supported), as fla 0.6 computes
    with them: head dims that divide, its intermediate size, dtype and gate clamp, its fixed gate."""
    d, heads = hf["hidden_size"], hf["num_heads"]
    expand_k, expand_v = float(hf.get("expand_k", 0.5)), float(hf.get("expand_v", 1.0))
    for field, expand in (("expand_k", expand_k), ("expand_v", expand_v)):
        if not math.isclose(d * expand, round(d * expand)) or round(d * expand) % heads:
            why = f"gives hidden_size*{field}={d * expand}, not an integer divisible by num_heads={heads}"
            _refuse(hf, where, field, why)
    if int(d * expand_k) != round(d * expand_k) or int(d * expand_v) != round(d * expand_v):
        _refuse(hf, where, "expand_k", "rounds differently in Laplace and fla")
    intermediate = hf.get("intermediate_size")
    if intermediate is None:
        intermediate = fla_intermediate_size(d, hf.get("hidden_ratio"))
    dtype = hf.get("dtype", hf.get("torch_dtype")) or "float32"
    if dtype not in DTYPE_NAMES:
        field = "dtype" if "dtype" in hf else "torch_dtype"
        _refuse(hf, where, field, f"is not a dtype Laplace serves in ({', '.join(DTYPE_NAMES)})")
    clamp = hf.get("clamp_min")
    if clamp is not None and not isinstance(clamp, (int, float)):
        _refuse(hf, where, "clamp_min", "must be a number or null")
    try:
        return validate_model_config(
            ModelConfig(
                vocab_size=hf["vocab_size"],
                d_model=d,
                n_layers=hf["num_hidden_layers"],
                n_heads=heads,
                expand_k=expand_k,
                expand_v=expand_v,
                mlp_hidden=int(intermediate),
                gate_low_rank_dim=FLA_GATE_LOW_RANK_DIM,
                gate_logit_normalizer=float(FLA_GATE_LOGIT_NORMALIZER),  # whatever config.json says: as fla
                gate_clamp_min=None if clamp is None else float(clamp),
                use_short_conv=bool(hf.get("use_short_conv", False)),
                conv_size=int(hf.get("conv_size", 4)),
                norm_eps=float(hf.get("norm_eps", FLA_NORM_EPS)),
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                init_std=float(hf.get("initializer_range", 0.02)),
                dtype=DTYPE_NAMES[dtype],
            ),
            prefix=where,
        )
    except InputError:
        raise
    except (TypeError, ValueError) as exc:
        raise HFFormatError(f"{where}: {one_line(exc)}") from exc


def known_keys() -> set[str]:
    """Every config.json key the importer has a rule for; any other is refused by name."""
    return (
        NEUTRAL_FIELDS
        | TRANSFORMERS_COMMON_KEYS
        | set(REQUIRED_VALUES)
        | MAPPED_FIELDS
        | LEGACY_FIELDS
        | set(FLA_IGNORES)
        | set(FLA_FIXED)
    )


def keys_fla_ignores(hf: dict) -> list[str]:
    """`key=value (fla computes with V)` for each key of FLA_IGNORES whose value is not the one fla
    computes with: the import computes fla's function and says which keys it did not obey."""
    return [
        f"{key}={json.dumps(hf[key])} (fla 0.6 reads no such key and computes with {json.dumps(fixed)})"
        for key, fixed in FLA_IGNORES.items()
        if key in hf and hf[key] != fixed
    ]


# --------------------------------------------------------------------------- hybrid attention layers


def _with_attention(cfg: ModelConfig, attn: dict | list | None, where: str) -> ModelConfig:
    if attn is None:
        return cfg
    return validate_model_config(dataclasses.replace(cfg, attn=attn), prefix=where)


def _attention_to_hf(cfg: ModelConfig) -> dict:
    """GLAConfig's `attn` for a Laplace architecture: the spec as Laplace keeps it (fla's normal form)."""
    return {"attn": cfg.attn}


def config_to_hf(cfg: ModelConfig, bos_id: int | None, eos_id: int | None) -> dict:
    """fla's GLAConfig fields for a Laplace architecture; HFFormatError where fla cannot express it."""
    for field, fixed in (
        ("gate_low_rank_dim", FLA_GATE_LOW_RANK_DIM),
        ("gate_logit_normalizer", FLA_GATE_LOGIT_NORMALIZER),
    ):
        if getattr(cfg, field) != fixed:
            raise HFFormatError(
                f"model.{field}={getattr(cfg, field)}: fla's GLA fixes it at {fixed}, so an HF export cannot carry it"
            )
    return {
        "architectures": ["GLAForCausalLM"],
        "model_type": "gla",
        "attn_mode": "chunk",
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_heads": cfg.n_heads,
        "num_kv_heads": None,
        "expand_k": cfg.expand_k,
        "expand_v": cfg.expand_v,
        "hidden_ratio": 4,
        "intermediate_size": cfg.ffn_dim,
        "use_short_conv": cfg.use_short_conv,
        "conv_size": cfg.conv_size,
        "use_output_gate": True,
        "feature_map": None,
        "clamp_min": cfg.gate_clamp_min,
        "hidden_act": "swish",
        "elementwise_affine": True,
        "norm_eps": cfg.norm_eps,
        "use_gk": True,
        "use_gv": False,
        "attn": None,
        **common_to_hf(cfg, bos_id, eos_id),
    }


# --------------------------------------------------------------------------- weights


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Laplace name -> shape of every tensor an export of `cfg` holds (from the real modules on meta)."""
    with torch.device("meta"):
        model = LaplaceLM(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_embeddings:
        shapes.pop("lm_head.weight")
    return shapes


def _read_safetensors(path: Path, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Tensors of one safetensors file (all, or `names`); a truncated or corrupt file is an HFFormatError."""
    if not path.is_file():
        raise HFFormatError(f"{path}: weight file missing")
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = list(f.keys()) if names is None else names
            missing = [k for k in keys if k not in f.keys()]
            if missing:
                raise HFFormatError(f"{path}: does not hold {missing[0]!r}, which the shard index places there")
            return {k: f.get_tensor(k) for k in keys}
    except (SafetensorError, OSError) as exc:
        raise HFFormatError(f"{path}: not a readable safetensors file, truncated? ({one_line(exc)})") from exc


def read_fla_weights(src: Path) -> dict[str, torch.Tensor]:
    """fla-named tensors from model.safetensors, or from the shards a model.safetensors.index.json lists."""
    index = src / INDEX
    if (src / WEIGHTS).is_file():
        return _read_safetensors(src / WEIGHTS)
    if not index.is_file():
        raise HFFormatError(f"{src}: no {WEIGHTS} or {INDEX} (not a safetensors checkpoint)")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        assert isinstance(weight_map, dict)
    except (ValueError, KeyError, TypeError, AssertionError) as exc:
        raise HFFormatError(f"{index}: not a safetensors shard index ({one_line(exc)})") from exc
    by_shard: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        by_shard.setdefault(shard, []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    for shard, names in sorted(by_shard.items()):
        if Path(shard).name != shard:
            raise HFFormatError(f"{index}: shard {shard!r} is not a file name in {src}")
        tensors.update(_read_safetensors(src / shard, sorted(names)))
    return tensors


def laplace_tensors(fla: dict[str, torch.Tensor], cfg: ModelConfig, where: Path) -> dict[str, torch.Tensor]:
    """fla tensors renamed to Laplace's, checked against the architecture: every expected name with
    its shape, nothing else (a tied head's copy of the embeddings is dropped)."""
    out, origin = {}, {}
    for name, t in fla.items():
        ours = from_fla_name(name)
        if ours == "lm_head.weight" and cfg.tie_embeddings:
            continue
        out[ours], origin[ours] = t, name
    expected = expected_shapes(cfg)
    missing = sorted(set(expected) - set(out))
    if missing:
        raise HFFormatError(f"{where}: weight {to_fla_name(missing[0])} missing ({len(missing)} missing in all)")
    extra = sorted(set(out) - set(expected))
    if extra:
        raise HFFormatError(f"{where}: unexpected weight {origin[extra[0]]} for this config.json")
    for name, shape in expected.items():
        if tuple(out[name].shape) != shape:
            raise HFFormatError(
                f"{where}: {origin[name]} has shape {list(out[name].shape)}, config.json implies {list(shape)}"
            )
    return out


# --------------------------------------------------------------------------- import


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_source(src: str) -> Path:
    """A local directory as it is; else a hub id through huggingface_hub (its cache first, then the
    hub); a one-line HFFormatError that names the id and how to download it when neither works."""
    path = Path(src)
    if path.exists():
        if not path.is_dir():
            raise HFFormatError(f"{src}: not a directory (give a checkpoint directory or a hub id)")
        return path
    if not HUB_ID.match(src):
        raise HFFormatError(f"{src}: no such directory, and not a hub id (owner/name)")
    from huggingface_hub import snapshot_download

    patterns = [
        "config.json",
        "*.safetensors",
        INDEX,
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
    ]
    try:
        return Path(snapshot_download(src, allow_patterns=patterns))
    except Exception as exc:  # offline, unknown repo, gated: all the same to the user
        raise HFFormatError(
            f"{src}: could not fetch it from the Hugging Face hub ({one_line(exc)}); on a machine that reaches "
            f"the hub run `hf download {src} --local-dir DIR` and then `laplace import DIR`"
        ) from exc


def import_checkpoint(src: str | Path, out_dir: Path) -> dict:
    """An fla/HF GLA checkpoint -> a Laplace export in `out_dir` (written whole, or not at all)."""
    src_dir = resolve_source(str(src))
    config_path = src_dir / "config.json"
    if not config_path.is_file():
        raise HFFormatError(f"{src_dir}: not a GLA checkpoint (config.json missing)")
    try:
        hf = json.loads(config_path.read_text())
        assert isinstance(hf, dict)
    except (ValueError, UnicodeDecodeError, AssertionError) as exc:
        raise HFFormatError(f"{config_path}: not a JSON object ({one_line(exc)})") from exc
    cfg, bos_id, eos_id = config_from_hf(hf, str(config_path))
    tokenizer_path = src_dir / TOKENIZER
    if not tokenizer_path.is_file():
        raise HFFormatError(f"{src_dir}: {TOKENIZER} missing (Laplace needs the model's own tokenizer)")
    tokenizer = load_tokenizer(tokenizer_path)
    vocab = tokenizer.get_vocab_size()
    if vocab > cfg.vocab_size:
        raise HFFormatError(f"{config_path}: vocab_size={cfg.vocab_size} is below the tokenizer's {vocab} tokens")
    for field, token in (("bos_token_id", bos_id), ("eos_token_id", eos_id)):
        if token is not None and tokenizer.id_to_token(token) is None:
            raise HFFormatError(f"{config_path}: {field}={token} is not a token of {tokenizer_path}")
    tensors = laplace_tensors(read_fla_weights(src_dir), cfg, src_dir)
    config = _laplace_config(hf.get("laplace"), cfg, tokenizer, bos_id, eos_id)
    config.pop("chat_template", None)  # the source's own template (below) decides, not a carried one
    if (template := read_chat_template(src_dir)) is not None:
        config["chat_template"] = template
    summary = write_export(tensors, config, tokenizer_path, Path(out_dir))
    return {**summary, "source": str(src), "model": cfg.architecture(), "ignored_keys": keys_fla_ignores(hf)}


def read_chat_template(src_dir: Path) -> str | None:
    """The checkpoint's chat template, where transformers keeps it: chat_template.jinja (transformers
    5's save_pretrained), else tokenizer_config.json's `chat_template` (a string, or a list of named
    templates of which transformers uses "default"). None when it has none."""
    jinja = src_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    path = src_dir / "tokenizer_config.json"
    if not path.is_file():
        return None
    try:
        template = json.loads(path.read_text(encoding="utf-8")).get("chat_template")
    except (ValueError, UnicodeDecodeError, AttributeError) as exc:
        raise HFFormatError(f"{path}: not a JSON object ({one_line(exc)})") from exc
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise HFFormatError(f"{path}: chat_template must be a string or a list of named templates")
    return template


def _laplace_config(carried: dict | None, cfg: ModelConfig, tokenizer, bos_id, eos_id) -> dict:
    """The export's config.json: the one a Laplace export carried out (so it comes back byte for
    byte) when it still describes these weights, else a fresh one at step 0."""
    fresh = {
        "format": FORMAT,
        "model": cfg.architecture(),
        "step": 0,
        "tokenizer_sha256": tokenizer_sha256(tokenizer),
        "bos_id": bos_id,
        "eos_id": eos_id,
    }
    if not isinstance(carried, dict) or not isinstance(carried.get("model"), dict):
        return fresh
    try:
        carried_cfg = validate_model_config(ModelConfig(**carried["model"]))
    except (TypeError, InputError):
        return fresh
    # fields fla has no place for (chunking, init; a GDN model's GLA sizes) come from the carried
    # config; the function must agree
    skip = NOT_IN_FLA + (hf_gdn.GLA_ONLY_FIELDS if cfg.gdn_layers and not cfg.gla_layers else ())
    same = {k: v for k, v in carried_cfg.architecture().items() if k not in skip}
    if same != {k: v for k, v in cfg.architecture().items() if k not in skip} or carried_cfg.ffn_dim != cfg.ffn_dim:
        return fresh
    if carried.get("tokenizer_sha256") != fresh["tokenizer_sha256"]:
        return fresh
    config = {k: v for k, v in carried.items() if k != "parameters"}
    config.update(bos_id=bos_id, eos_id=eos_id)
    return config


# ModelConfig fields with no GLAConfig field: how our kernels chunk, and how a fresh model is drawn
NOT_IN_FLA = ("chunk_size", "sub_chunk_size", "segment_len", "gate_bias_init", "mlp_hidden")


# --------------------------------------------------------------------------- export


def export_hf(export_dir: Path, out_dir: Path) -> dict:
    """A Laplace export -> fla's layout in `out_dir` (written whole, or not at all)."""
    export_dir, out_dir = Path(export_dir), Path(out_dir)
    config, tensors = load_export_tensors(export_dir)
    cfg = validate_model_config(ModelConfig(**config["model"]))
    tokenizer = load_tokenizer(export_dir / TOKENIZER)
    bos_id, eos_id = config.get("bos_id"), config.get("eos_id")
    if cfg.gdn_layers:
        hf = {**hf_gdn.config_to_hf(cfg, bos_id, eos_id), "laplace": config}
    else:
        hf = {**config_to_hf(cfg, bos_id, eos_id), **_attention_to_hf(cfg), "laplace": config}
    fla = {to_fla_name(k): v.contiguous() for k, v in sorted(tensors.items())}
    tmp = staging_dir(out_dir)
    try:
        # metadata format "pt": transformers refuses a safetensors file without it
        save_file(fla, str(tmp / WEIGHTS), metadata={"format": "pt"})
        shutil.copyfile(export_dir / TOKENIZER, tmp / TOKENIZER)
        atomic_write_json(tmp / "config.json", hf)
        atomic_write_json(tmp / "generation_config.json", _generation_config(bos_id, eos_id))
        specials = _special_tokens(tokenizer, bos_id, eos_id)
        atomic_write_json(tmp / "special_tokens_map.json", specials)
        atomic_write_json(
            tmp / "tokenizer_config.json",
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": 1_000_000_000,
                "clean_up_tokenization_spaces": False,
                **specials,
                # the export's chat template, where transformers' apply_chat_template reads it
                **({"chat_template": config["chat_template"]} if config.get("chat_template") else {}),
            },
        )
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"hf_dir": str(out_dir), "tensors": len(fla), "parameters": sum(t.numel() for t in fla.values())}


def _generation_config(bos_id, eos_id) -> dict:
    out = {"_from_model_config": True, "use_cache": True}
    if bos_id is not None:
        out["bos_token_id"] = bos_id
    if eos_id is not None:
        out["eos_token_id"] = eos_id
    return out


def _special_tokens(tokenizer, bos_id, eos_id) -> dict:
    out = {}
    for key, token_id in (("bos_token", bos_id), ("eos_token", eos_id)):
        if token_id is not None:
            out[key] = tokenizer.id_to_token(token_id)
    return out
