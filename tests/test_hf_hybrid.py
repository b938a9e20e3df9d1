"""fla 0.6 hybrid and softmax checkpoints (GLAConfig(attn=...)) in and out of Laplace: built with
fla's own modules, imported, exported back bit for bit and loaded strictly by fla, fla's real
forward (tests/fla_cpu_forward.py: its Triton kernels interpreted on the CPU, flash-attn replaced by
an exact torch transcription) against Laplace's logits, and checkpoints that do not match their config."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from laplace.model.export import load_export
from laplace.model.hf import export_hf, import_checkpoint, to_fla_name
from laplace.pipeline import cli

from hf_fixture import fla_attention_on_cpu, fla_checkpoint, read_json

pytest.importorskip("fla", reason="flash-linear-attention (the dev extra) builds the fla-format checkpoints")

HERE = Path(__file__).parent
KINDS = {
    # 3 layers, the middle one softmax attention with grouped kv heads, q/k/v bias and a window
    "hybrid": dict(
        num_hidden_layers=3,
        attn={"layers": [1], "num_heads": 4, "num_kv_heads": 2, "qkv_bias": True, "window_size": 8},
    ),
    # every layer attention: a plain softmax transformer in fla's GLA code
    "softmax": dict(num_hidden_layers=2, attn=[{"layers": [0, 1], "num_heads": 4, "rope_theta": 500.0}]),
}


@pytest.fixture(scope="module", params=list(KINDS))
def checkpoint(request, tmp_path_factory) -> tuple[str, Path, Path]:
    """(kind, fla checkpoint, its Laplace import)."""
    root = tmp_path_factory.mktemp(request.param)
    src = fla_checkpoint(root / "fla", seed=4, **KINDS[request.param])
    import_checkpoint(src, root / "imported")
    return request.param, src, root / "imported"


def test_import_then_export_is_bit_exact_and_fla_loads_it_strictly(checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    kind, src, imported = checkpoint
    config = read_json(imported / "config.json")["model"]
    assert config["attn"] == read_json(src / "config.json")["attn"]  # fla's normal form, as GLAConfig saved it
    export_hf(imported, tmp_path / "hf")
    theirs, ours = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(theirs) == sorted(ours)
    assert any(".attn.q_proj." in name for name in ours)
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name
    with fla_attention_on_cpu():
        model, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.config.attn == config["attn"]
    assert type(model.model.layers[1].attn).__name__ == "Attention"
    for name, tensor in load_export(imported)[0].state_dict().items():
        assert torch.equal(model.state_dict()[to_fla_name(name)], tensor), name
    # and that export imported again is the same Laplace export, byte for byte
    import_checkpoint(tmp_path / "hf", tmp_path / "again")
    for name in ("config.json", "model.safetensors", "manifest.json"):
        assert (tmp_path / "again" / name).read_bytes() == (imported / name).read_bytes(), name


def test_laplace_logits_equal_flas_own_forward(checkpoint, tmp_path):
    """fla's real modules (GLA layers, Attention, RoPE, fused norms) computing on the CPU, against
    Laplace's import: the same function within fp32 rounding (rel. max error 1e-4, the CUDA test's bound)."""
    kind, src, imported = checkpoint
    tokens = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(5))
    save_file({"tokens": tokens}, str(tmp_path / "tokens.safetensors"))
    run = subprocess.run(
        [
            sys.executable,
            str(HERE / "fla_cpu_forward.py"),
            str(src),
            str(tmp_path / "tokens.safetensors"),
            str(tmp_path / "out.safetensors"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    expected = load_file(str(tmp_path / "out.safetensors"))["logits"]
    model = load_export(imported, kernel="torch")[0]
    with torch.no_grad():
        got = model(tokens)
    assert got.shape == expected.shape
    assert (got - expected).abs().max() / expected.abs().max() < 1e-4
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.fixture(scope="module")
def hybrid_src(tmp_path_factory) -> Path:
    return fla_checkpoint(tmp_path_factory.mktemp("hybrid-src") / "fla", seed=4, **KINDS["hybrid"])


def _damaged(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    config = read_json(dst / "config.json")
    edit(tensors, config)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t, c: t.pop("model.layers.1.attn.q_proj.bias"), r"weight model\.layers\.1\.attn\.q_proj\.bias missing"),
        (
            lambda t, c: c["attn"].update(num_kv_heads=4),
            r"model\.layers\.1\.attn\.k_proj\.weight has shape \[32, 64\], config\.json implies \[64, 64\]",
        ),
        (lambda t, c: c["attn"].update(qkv_bias=False), r"unexpected weight model\.layers\.1\.attn\.k_proj\.bias"),
        (lambda t, c: c["attn"].update(layers=[3]), r"attn: attn specification field 'layers' contains out-of-range"),
        (lambda t, c: c["attn"].update(num_heads=3), r"attn\.num_heads: 3 does not divide d_model=64"),
        (lambda t, c: c["attn"].update(layers=[2]), r"unexpected weight model\.layers\.1\.attn\.\w+|missing"),
    ],
    ids=["bias-missing", "kv-heads", "bias-unexpected", "layer-out-of-range", "heads-do-not-divide", "moved-layer"],
)
def test_attention_weights_that_do_not_match_the_config_are_one_line_exit_2(
    hybrid_src, tmp_path, capsys, edit, message
):
    bad = _damaged(hybrid_src, tmp_path / "bad", edit)
    capsys.readouterr()
    status = cli.main(["import", str(bad), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1, err
    assert re.search(message, err), err
    assert not (tmp_path / "out").exists()
