"""fla gated_deltanet checkpoints in and out: an fla GatedDeltaNetForCausalLM's logits reproduced,
fla's from_pretrained loading what Laplace exports, and every GatedDeltaNetConfig key either
computing fla's function or refused by name.

The reference is fla's own model (its modules, config handling and weight layout) on the CPU, its
Triton entry points replaced by transcriptions of what the kernels compute (hf_fixture.fla_gdn_on_cpu).
Both sides run in fp64: the measured difference is ~1e-15 of the logits' scale (the same function,
summed in other orders), so the bound is 1e-10 as for GLA's imports (tests/test_hf.py)."""

import inspect
import json
import re
from pathlib import Path

import pytest
import torch

from laplace.model.config import ModelConfig, validate_model_config
from laplace.model.export import load_export
from laplace.model.hf import HFFormatError, export_hf, import_checkpoint
from laplace.model.lm import LaplaceLM
from laplace.pipeline import cli

from hf_fixture import fla_gdn_checkpoint, fla_gdn_logits
from project import write_model_export

TOKENS = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(0))
TOL = 1e-10


def close(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    return bool((ours - theirs).abs().max() <= TOL * theirs.abs().max())


def test_an_fla_gdn_model_imports_computes_the_same_and_exports_back(tmp_path):
    """GVA and allow_neg_eigval on; the export goes back through fla's from_pretrained with no
    missing or unexpected weight and computes the same logits."""
    from fla.models import GatedDeltaNetForCausalLM

    src = fla_gdn_checkpoint(tmp_path / "fla", num_heads=1, num_v_heads=2, allow_neg_eigval=True)
    summary = import_checkpoint(src, tmp_path / "imported")
    assert summary["model"]["gdn"]["layers"] == [0, 1] and summary["model"]["gdn"]["num_v_heads"] == 2
    model = load_export(tmp_path / "imported")[0]
    theirs = fla_gdn_logits(src, TOKENS, dtype=torch.float64)
    assert close(model.double()(TOKENS), theirs)

    export_hf(tmp_path / "imported", tmp_path / "back")
    _, info = GatedDeltaNetForCausalLM.from_pretrained(str(tmp_path / "back"), output_loading_info=True)
    assert not any(info.values()), info  # strict: nothing missing, unexpected or mismatched
    assert close(fla_gdn_logits(tmp_path / "back", TOKENS, dtype=torch.float64), theirs)
    # and in again: the carried Laplace config comes back with the same weights, bit for bit
    import_checkpoint(tmp_path / "back", tmp_path / "again")
    again = load_export(tmp_path / "again")[0]
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.float().state_dict().values()))


def test_a_laplace_gdn_hybrid_exports_with_its_attention_layers_and_a_gla_mix_is_refused(tmp_path):
    tokenizer = fla_gdn_checkpoint(tmp_path / "tok") / "tokenizer.json"
    gdn = {"num_heads": 2, "head_dim": 16}
    cfg = validate_model_config(
        ModelConfig(
            vocab_size=320,
            d_model=64,
            n_layers=3,
            n_heads=2,
            attn={"layers": [2], "num_heads": 2},
            gdn={"layers": [0, 1], **gdn},
        )
    )
    torch.manual_seed(0)
    export = write_model_export(LaplaceLM(cfg), tokenizer, tmp_path / "hybrid")
    export_hf(export, tmp_path / "hf")
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf["model_type"] == "gated_deltanet" and hf["attn"]["layers"] == [2]
    import_checkpoint(tmp_path / "hf", tmp_path / "in")
    assert load_export(tmp_path / "in")[0].cfg.architecture() == cfg.architecture()

    mix = validate_model_config(
        ModelConfig(vocab_size=320, d_model=64, n_layers=2, n_heads=2, gdn={"layers": [0], **gdn})
    )
    export = write_model_export(LaplaceLM(mix), tokenizer, tmp_path / "mix")
    with pytest.raises(HFFormatError, match=r"model\.gdn: layers \[1\] are GLA"):
        export_hf(export, tmp_path / "hf-mix")
    assert not (tmp_path / "hf-mix").exists()


SAME, REFUSED = "computes fla's function", "refused by name"
# key -> (the config fields that set it, what the import must do); each one off fla's default
CASES = {
    "attn_mode": ({"attn_mode": "fused_recurrent"}, SAME),
    "hidden_size": ({"hidden_size": 96}, SAME),
    "expand_v": ({"expand_v": 1.5}, SAME),
    "use_gate": ({"use_gate": False}, REFUSED),
    "use_short_conv": ({"use_short_conv": False}, SAME),
    "allow_neg_eigval": ({"allow_neg_eigval": True}, SAME),
    "conv_size": ({"conv_size": 3}, SAME),
    "head_dim": ({"head_dim": 8}, SAME),
    "num_heads": ({"num_heads": 4}, SAME),
    "num_v_heads": ({"num_v_heads": 4}, SAME),
    "num_v_heads-not-a-multiple": ({"num_v_heads": 3}, REFUSED),
    "max_position_embeddings": ({"max_position_embeddings": 16}, SAME),
    "hidden_ratio": ({"hidden_ratio": 2}, SAME),
    "intermediate_size": ({"intermediate_size": 96}, SAME),
    "hidden_act": ({"hidden_act": "relu"}, REFUSED),
    "num_hidden_layers": ({"num_hidden_layers": 3}, SAME),
    "norm_eps": ({"norm_eps": 0.05}, SAME),
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
    "output_gate_activation": ({"output_gate_activation": "sigmoid"}, REFUSED),
    # transformers' common keys, and ones the gated_deltanet importer has no rule for
    "dtype": ({"dtype": "float32"}, SAME),
    "id2label": ({"id2label": {"0": "no", "1": "yes"}}, SAME),
    "conv_bias": ({"conv_bias": True}, REFUSED),
    "use_rope": ({"use_rope": True}, REFUSED),
}
ELSEWHERE = {"attn"}  # the attention layers: the hybrid test above (fla's RoPE is Triton-only)


def test_every_gated_deltanet_config_field_has_a_case():
    from fla.models import GatedDeltaNetConfig

    fields = set(inspect.signature(GatedDeltaNetConfig.__init__).parameters) - {"self", "kwargs"}
    assert fields - ELSEWHERE <= set(CASES), sorted(fields - ELSEWHERE - set(CASES))


def _saved_by_fla(out: Path, fields: dict) -> Path:
    """fla builds and saves the model with `fields`; where fla refuses to build it, its default model
    is saved and config.json given the fields, as a hand-edited checkpoint would be."""
    try:
        return fla_gdn_checkpoint(out, **fields)
    except (ValueError, AssertionError, KeyError, TypeError):
        fla_gdn_checkpoint(out)
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, **fields}))
        return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_config_key_computes_flas_function_or_is_refused_by_name(case, tmp_path, capsys):
    fields, expected = CASES[case]
    src = _saved_by_fla(tmp_path / "fla", fields)
    key = next(iter(fields))
    assert key in json.loads((src / "config.json").read_text())
    capsys.readouterr()
    status = cli.main(["import", str(src), "--out", str(tmp_path / "imported")])
    out, err = capsys.readouterr()
    if expected == REFUSED:
        assert status == 2, out
        assert len(err.strip().splitlines()) == 1 and re.search(rf"\b{key}=", err), err
        assert not (tmp_path / "imported").exists()
        return
    assert status == 0, err
    theirs = fla_gdn_logits(src, TOKENS, dtype=torch.float64)
    assert close(load_export(tmp_path / "imported")[0].double()(TOKENS), theirs), case
