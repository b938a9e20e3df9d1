"""fla gated_deltanet checkpoints in and out: an fla GatedDeltaNetForCausalLM's logits reproduced,
fla's from_pretrained loading what Laplace exports, a hybrid with attention layers, a GLA mix refused.
Every GatedDeltaNetConfig key either computing fla's function or refused by name: tests/test_hf.py's
config matrix, over both families.

The reference is fla's own model (its modules, config handling and weight layout) on the CPU, its
Triton entry points replaced by transcriptions of what the kernels compute (hf_fixture.fla_gdn_on_cpu).
Both sides run in fp64: the measured difference is ~1e-15 of the logits' scale (the same function,
summed in other orders), so the bound is 1e-10 as for GLA's imports (tests/test_hf.py)."""

import json

import pytest
import torch

from laplace.model.config import ModelConfig, validate_model_config
from laplace.model.export import load_export
from laplace.model.hf import HFFormatError, export_hf, import_checkpoint
from laplace.model.lm import LaplaceLM

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
