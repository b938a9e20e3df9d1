"""Every config.json key against fla 0.6 itself: each GLAConfig field and each known extra key is
set to a value other than its default, saved with fla's own save_pretrained, and imported with
`laplace import`. The import either computes fla's function (logits against fla's own forward, in
fp64) or is refused with one line naming the key. A key fla stores but never reads
(gate_logit_normalizer ...) is not obeyed by the import either: fla does not obey it."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest
import torch

from laplace.model.export import load_export
from laplace.model.hf import FLA_FIXED, FLA_IGNORES
from laplace.pipeline import cli

from hf_fixture import fla_checkpoint, fla_logits

pytest.importorskip("fla", reason="flash-linear-attention (the dev extra) is the reference")

SAME, REFUSED = "computes fla's function", "refused by name"
# key -> (the config fields that set it, what the import must do)
CASES = {
    # GLAConfig's own fields
    "hidden_size": ({"hidden_size": 96}, SAME),
    "expand_k": ({"expand_k": 1.0}, SAME),
    "expand_v": ({"expand_v": 0.5}, SAME),
    "hidden_ratio": ({"hidden_ratio": 2}, SAME),
    "intermediate_size": ({"intermediate_size": 96}, SAME),
    "num_hidden_layers": ({"num_hidden_layers": 3}, SAME),
    "num_heads": ({"num_heads": 4}, SAME),
    "num_kv_heads": ({"num_kv_heads": 1}, REFUSED),
    "feature_map": ({"feature_map": "relu"}, REFUSED),
    "attn_mode": ({"attn_mode": "fused_recurrent"}, SAME),
    "use_short_conv": ({"use_short_conv": False}, SAME),
    "conv_size": ({"conv_size": 3}, SAME),
    "use_output_gate": ({"use_output_gate": False}, REFUSED),
    "clamp_min": ({"clamp_min": -0.2}, SAME),
    "hidden_act": ({"hidden_act": "relu"}, REFUSED),
    "max_position_embeddings": ({"max_position_embeddings": 16}, SAME),
    "elementwise_affine": ({"elementwise_affine": False}, REFUSED),
    "norm_eps": ({"norm_eps": 0.05}, SAME),
    "use_gk": ({"use_gk": False}, SAME),  # fla 0.6 reads neither: always gk, never gv
    "use_gv": ({"use_gv": True}, SAME),
    "use_cache": ({"use_cache": False}, SAME),
    "pad_token_id": ({"pad_token_id": 0}, SAME),
    "bos_token_id": ({"bos_token_id": 5}, SAME),
    "eos_token_id": ({"eos_token_id": 6}, SAME),
    "tie_word_embeddings": ({"tie_word_embeddings": True}, SAME),
    "initializer_range": ({"initializer_range": 0.5}, SAME),
    "fuse_norm": ({"fuse_norm": False}, SAME),
    "fuse_swiglu": ({"fuse_swiglu": False}, SAME),
    "fuse_cross_entropy": ({"fuse_cross_entropy": False}, SAME),
    "fuse_linear_cross_entropy": ({"fuse_linear_cross_entropy": True, "fuse_cross_entropy": False}, SAME),
    "use_l2warp": ({"use_l2warp": True}, SAME),
    "vocab_size": ({"vocab_size": 400}, SAME),
    "attnres_block_size": ({"attnres_block_size": 2}, REFUSED),
    # extra keys GLAConfig keeps (PreTrainedConfig style) and fla's layers never read
    "gate_logit_normalizer": ({"gate_logit_normalizer": 8}, SAME),
    "gate_low_rank_dim": ({"gate_low_rank_dim": 8}, REFUSED),
    "conv_bias": ({"conv_bias": True}, SAME),
    # earlier fla releases' keys (the published fla-hub checkpoints carry them)
    "rms_norm_eps": ({"rms_norm_eps": 1e-3}, REFUSED),
    "rms_norm_eps-agrees": ({"rms_norm_eps": 1e-6}, SAME),
    "share_conv_kernel": ({"share_conv_kernel": True}, REFUSED),
    # transformers' common keys, and one nobody knows
    "id2label": ({"id2label": {"0": "no", "1": "yes"}}, SAME),
    "problem_type": ({"problem_type": "single_label_classification"}, SAME),
    "dtype": ({"dtype": "float32"}, SAME),
    "use_rope": ({"use_rope": True}, REFUSED),
}
# hybrid attention layers (`attn`) are issue 31's, tested with the hybrid models
ELSEWHERE = {"attn"}
TOKENS = torch.randint(0, 300, (2, 80), generator=torch.Generator().manual_seed(0))  # > 64: fla's chunk mode


def test_every_glaconfig_field_and_known_extra_key_has_a_case():
    from fla.models import GLAConfig

    fields = set(inspect.signature(GLAConfig.__init__).parameters) - {"self", "kwargs"}
    assert fields - ELSEWHERE <= set(CASES), sorted(fields - ELSEWHERE - set(CASES))
    assert set(FLA_IGNORES) | set(FLA_FIXED) <= set(CASES)


def _saved_by_fla(out: Path, fields: dict) -> Path:
    """fla builds and saves the model with `fields`; where fla itself refuses to build it, fla's
    default model is saved and config.json given the fields, as a hand-edited checkpoint would be."""
    try:
        return fla_checkpoint(out, strong_gates=True, **fields)
    except (ValueError, AssertionError, KeyError, TypeError):
        fla_checkpoint(out, strong_gates=True)
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, **fields}))
        return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_config_key_computes_flas_function_or_is_refused_by_name(case, tmp_path, capsys):
    fields, expected = CASES[case]
    src = _saved_by_fla(tmp_path / "fla", fields)
    key = next(iter(fields))
    assert key in json.loads((src / "config.json").read_text())  # fla wrote it (GLAConfig keeps extra keys)
    capsys.readouterr()  # what saving printed
    status = cli.main(["import", str(src), "--out", str(tmp_path / "imported")])
    out, err = capsys.readouterr()
    if expected == REFUSED:
        assert status == 2, out
        assert len(err.strip().splitlines()) == 1 and re.search(rf"\b{key}=", err), err
        assert not (tmp_path / "imported").exists()
        return
    assert status == 0, err
    theirs = fla_logits(src, TOKENS, dtype=torch.float64)
    ours = load_export(tmp_path / "imported")[0].double()(TOKENS)
    assert (ours - theirs).abs().max() <= 1e-10 * theirs.abs().max(), case
    if key in FLA_IGNORES:  # named, as not obeyed
        assert f"note: config.json {key}=" in out, out


def test_obeying_an_ignored_key_would_be_visible(tmp_path):
    """The matrix can fail: the same weights computed with logsigmoid/8 (what the key's name says)
    are far from fla's logits, which the import matches."""
    import dataclasses

    from laplace.model.lm import LaplaceLM

    src = fla_checkpoint(tmp_path / "fla", strong_gates=True, gate_logit_normalizer=8)
    assert cli.main(["import", str(src), "--out", str(tmp_path / "imported")]) == 0
    model, _ = load_export(tmp_path / "imported")[:2]
    obeyed = LaplaceLM(dataclasses.replace(model.cfg, gate_logit_normalizer=8.0)).double()
    obeyed.load_state_dict(model.state_dict())
    theirs = fla_logits(src, TOKENS, dtype=torch.float64)
    assert (obeyed(TOKENS) - theirs).abs().max() > 1e-2 * theirs.abs().max()
    assert (model.double()(TOKENS) - theirs).abs().max() <= 1e-10 * theirs.abs().max()
