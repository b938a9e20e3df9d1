"""What the checkpoint formats of flash-linear-attention's model families share (laplace.model.hf for
GLA and its hybrids, laplace.model.hf_gdn for Gated DeltaNet): the error, transformers' and fla's
keys that do not change the function, dtypes, the MLP's size rule, token ids, the hybrid's `attn`, and
the fields every export writes alike."""

from __future__ import annotations

import json
from typing import NoReturn

from laplace.errors import InputError
from laplace.model.config import AttentionSpecError, ModelConfig, parse_attention_config

FLA_INTERMEDIATE_MULTIPLE = 256


class HFFormatError(InputError):
    pass


# transformers' own bookkeeping and fla's implementation switches: the same function either way
NEUTRAL_FIELDS = {
    "architectures",
    "transformers_version",
    "_name_or_path",
    "use_cache",
    "pad_token_id",
    "max_position_embeddings",
    "fuse_norm",
    "fuse_swiglu",
    "fuse_cross_entropy",
    "fuse_linear_cross_entropy",
    "use_l2warp",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "tie_encoder_decoder",
    "keys_to_ignore_at_inference",
    "laplace",
}
# transformers' PreTrainedConfig keys (v5, and the v4 ones older config.json files carry): a causal
# LM's logits do not depend on them (labels and problem types are for classification heads, the
# sampling defaults for generate(), the rest are switches GLAForCausalLM does not implement)
TRANSFORMERS_COMMON_KEYS = {
    "id2label",
    "label2id",
    "problem_type",
    "num_labels",
    "finetuning_task",
    "tokenizer_class",
    "prefix",
    "sep_token_id",
    "decoder_start_token_id",
    "task_specific_params",
    "torchscript",
    "use_bfloat16",
    "tf_legacy_loss",
    "is_decoder",
    "add_cross_attention",
    "cross_attention_hidden_size",
    "max_length",
    "min_length",
    "do_sample",
    "early_stopping",
    "num_beams",
    "num_beam_groups",
    "diversity_penalty",
    "temperature",
    "top_k",
    "top_p",
    "typical_p",
    "repetition_penalty",
    "length_penalty",
    "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size",
    "bad_words_ids",
    "num_return_sequences",
    "output_scores",
    "return_dict_in_generate",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "remove_invalid_values",
    "exponential_decay_length_penalty",
    "suppress_tokens",
    "begin_suppress_tokens",
}
# config.json fields both families' importers map onto ModelConfig fields (each adds its own)
COMMON_MAPPED_FIELDS = {
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_heads",
    "expand_v",
    "hidden_ratio",
    "intermediate_size",
    "use_short_conv",
    "conv_size",
    "norm_eps",
    "tie_word_embeddings",
    "initializer_range",
    "bos_token_id",
    "eos_token_id",
    "dtype",
    "torch_dtype",
}
DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "float64": "float64"}


def fla_intermediate_size(hidden_size: int, hidden_ratio: float | None) -> int:
    """GatedMLP's rule when intermediate_size is null: 2/3 * hidden * ratio up to a multiple of 256."""
    raw = int(hidden_size * (4 if hidden_ratio is None else hidden_ratio) * 2 / 3)
    return FLA_INTERMEDIATE_MULTIPLE * ((raw + FLA_INTERMEDIATE_MULTIPLE - 1) // FLA_INTERMEDIATE_MULTIPLE)


def refuse(hf: dict, where: str, field: str, why: str) -> NoReturn:
    """The one-line refusal of a config.json field, with its value."""
    raise HFFormatError(f"{where}: {field}={json.dumps(hf.get(field))} {why}")


def split_attention(hf: dict, where: str) -> tuple[dict, dict | list | None]:
    """(config.json without `attn`, its AttentionSpec(s) parsed as fla's GLAConfig parses them):
    a hybrid's softmax attention layers (fla.layers.attn.Attention) become Laplace's own."""
    if hf.get("attn") is None:
        return hf, None
    n_layers = hf.get("num_hidden_layers")
    try:
        attn = parse_attention_config(hf["attn"], n_layers if isinstance(n_layers, int) else -1)
    except AttentionSpecError as exc:
        raise HFFormatError(f"{where}: attn: {exc}") from None
    return {k: v for k, v in hf.items() if k != "attn"}, attn


def token_id(hf: dict, field: str, where: str) -> int | None:
    value = hf.get(field)
    if isinstance(value, list):  # transformers allows several end ids; Laplace stops on one
        value = value[0] if value else None
    if value is not None and not isinstance(value, int):
        raise HFFormatError(f"{where}: {field}={json.dumps(value)} must be a token id")
    return value


def common_to_hf(cfg: ModelConfig, bos_id: int | None, eos_id: int | None) -> dict:
    """The config.json fields every family's export ends with, in this order: fla's fused-kernel
    switches (on, fla's defaults), the embeddings, the vocabulary and its token ids, the dtype."""
    return {
        "fuse_norm": True,
        "fuse_swiglu": True,
        "fuse_cross_entropy": True,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "vocab_size": cfg.vocab_size,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": None,
        "dtype": cfg.dtype,
        "use_cache": True,
    }
