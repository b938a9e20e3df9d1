"""The HF / flash-linear-attention layout: import, export, round trips, from_pretrained, the gate
clamp, fine-tuning from an import (model.init), a given tokenizer's conventions, and bad input."""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from laplace.model.config import ModelConfig
from laplace.model.export import load_export
from laplace.model.hf import FLA_FIXED, FLA_IGNORES, config_from_hf, export_hf, import_checkpoint
from laplace.model.lm import LaplaceLM
from laplace.pipeline import cli

from hf_fixture import (
    TEXT,
    fla_checkpoint,
    fla_gdn_checkpoint,
    fla_gdn_logits,
    fla_logits,
    llama_style_tokenizer,
    read_json,
)
from project import write_model_export

fla = pytest.importorskip("fla", reason="flash-linear-attention (the dev extra) builds the fla-format checkpoints")
FILES = ("config.json", "model.safetensors", "tokenizer.json", "manifest.json")


@pytest.fixture(scope="module")
def fla_dir(tmp_path_factory) -> Path:
    return fla_checkpoint(tmp_path_factory.mktemp("fla") / "gla")


@pytest.fixture(scope="module")
def imported(fla_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("imported") / "export"
    import_checkpoint(fla_dir, out)
    return out


def test_fla_checkpoint_imports_and_exports_back_bit_for_bit(fla_dir, imported, tmp_path):
    hf_dir = tmp_path / "hf"
    export_hf(imported, hf_dir)
    theirs, ours = load_file(str(fla_dir / "model.safetensors")), load_file(str(hf_dir / "model.safetensors"))
    assert sorted(theirs) == sorted(ours)
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name
    config = read_json(imported / "config.json")
    assert config["bos_id"] == 1 and config["eos_id"] == 2  # from the checkpoint's config.json
    assert config["model"]["gate_clamp_min"] is None  # fla's default: no clamp, kept as the model's
    # and importing that export again gives the same Laplace export, byte for byte
    import_checkpoint(hf_dir, tmp_path / "again")
    for name in FILES:
        assert (tmp_path / "again" / name).read_bytes() == (imported / name).read_bytes(), name


def test_hf_export_loads_strictly_with_from_pretrained(imported, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export_hf(imported, tmp_path / "hf")
    model, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    assert type(model).__name__ == "GLAForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.config.clamp_min is None and model.config.use_short_conv is True
    ours = load_export(imported)[0].state_dict()
    from laplace.model.hf import to_fla_name

    theirs = model.state_dict()
    for name, tensor in ours.items():
        assert torch.equal(theirs[to_fla_name(name)], tensor), name
    # the tokenizer comes with its conventions: the same ids as ours, BOS first (Llama's rule)
    hf_tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    tok = load_export(imported)[1]
    assert hf_tok(TEXT).input_ids == tok.encode(TEXT).ids
    assert tok.encode(TEXT).ids[0] == 1 and hf_tok.bos_token == "<s>" and hf_tok.eos_token == "</s>"


def _laplace_export(tmp_path: Path, **model) -> tuple[Path, LaplaceLM]:
    """A Laplace export of a random model (Laplace's own conventions: gate clamp -10)."""
    cfg = ModelConfig(vocab_size=320, d_model=64, n_layers=2, n_heads=2, chunk_size=16, sub_chunk_size=8, **model)
    torch.manual_seed(3)
    lm = LaplaceLM(cfg)
    with torch.no_grad():
        for p in lm.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    tok = llama_style_tokenizer(tmp_path / "tok" / "tokenizer.json")
    return write_model_export(lm, tok, tmp_path / "laplace", step=7, bos_id=1, eos_id=2), lm


@pytest.mark.parametrize("tie", [False, True])
def test_laplace_export_out_and_back_is_byte_identical_and_computes_the_same(tmp_path, tie):
    original, lm = _laplace_export(tmp_path, tie_embeddings=tie)
    export_hf(original, tmp_path / "hf")
    hf = read_json(tmp_path / "hf" / "config.json")
    assert hf["clamp_min"] == -10.0 and hf["tie_word_embeddings"] is tie
    import_checkpoint(tmp_path / "hf", tmp_path / "back")
    for name in FILES:
        assert (tmp_path / "back" / name).read_bytes() == (original / name).read_bytes(), name
    model = load_export(tmp_path / "back")[0]
    tokens = torch.randint(0, 320, (2, 40))
    assert torch.equal(model(tokens), lm.eval()(tokens))


def test_the_gate_clamp_is_the_models_own(tmp_path):
    """clamp_min is respected: a model clamped at -0.5 computes differently from the same weights
    unclamped, and exactly as the naive recurrence of the clamped gate."""
    torch.manual_seed(0)
    base = dict(vocab_size=64, d_model=32, n_layers=1, n_heads=2, chunk_size=16, sub_chunk_size=8)
    unclamped = LaplaceLM(ModelConfig(**base, gate_clamp_min=None)).double()
    with torch.no_grad():
        unclamped.blocks[0].attn.gk_proj[1].bias.fill_(-30.0)  # log decays near -2, below -0.5
    clamped = LaplaceLM(ModelConfig(**base, gate_clamp_min=-0.5)).double()
    clamped.load_state_dict(unclamped.state_dict())
    tokens = torch.randint(0, 64, (1, 24))
    a, b = unclamped(tokens), clamped(tokens)
    assert (a - b).abs().max() > 1e-3
    # the clamped model's prefill then decode equals its parallel form (the clamp holds in every form)
    state = clamped.allocate_state(1)
    clamped.prefill(tokens[:, :12], state)
    stepped = [clamped.decode_step(tokens[:, t], state) for t in range(12, 24)]
    assert torch.allclose(torch.stack(stepped, 1), b[:, 12:], atol=1e-10)
    with pytest.raises(Exception, match="gate_clamp_min"):
        from laplace.model.config import validate_model_config

        validate_model_config(ModelConfig(**base, gate_clamp_min=0.5))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fla's forward runs Triton kernels: CUDA only")
def test_imported_logits_match_flas_own_forward_on_cuda(fla_dir, imported):
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(str(fla_dir)).cuda().float().eval()
    ours = load_export(imported, device="cuda", kernel="torch")[0]
    tokens = torch.randint(0, 300, (2, 200), device="cuda")
    with torch.no_grad():
        expected = theirs(tokens).logits.float()
        got = ours(tokens).float()
    assert (got - expected).abs().max() / expected.abs().max() < 1e-4


# --------------------------------------------------------------------------- bad input


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(d: Path, **fields) -> Path:
    config = read_json(d / "config.json")
    config.update(fields)
    (d / "config.json").write_text(json.dumps(config))
    return d


def _import_cli(src, out: Path, capsys) -> tuple[int, str]:
    status = cli.main(["import", str(src), "--out", str(out)])
    return status, capsys.readouterr().err.strip()


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: _edit_config(d, model_type="llama"), r'model_type="llama" is not a GLA checkpoint'),
        (lambda d: _edit_config(d, feature_map="relu"), r'feature_map="relu" is not supported'),
        (lambda d: _edit_config(d, use_output_gate=False), r"use_output_gate=false is not supported"),
        (  # a GLA layer's weights where the config now says attention (tests/test_export.py: hybrids)
            lambda d: _edit_config(d, attn={"layers": [1], "num_heads": 2}),
            r"unexpected weight model\.layers\.1\.attn\.\S+ for this config\.json",
        ),
        (lambda d: _edit_config(d, num_kv_heads=1), r"num_kv_heads=1 is not supported"),
        (lambda d: _edit_config(d, use_rope=True), r"use_rope=true is a field Laplace does not know"),
        (lambda d: _edit_config(d, share_conv_kernel=True), r"share_conv_kernel=true is a short convolution shared"),
        (lambda d: _edit_config(d, rms_norm_eps=1e-5), r"rms_norm_eps=1e-05 disagrees with norm_eps=1e-06"),
        (lambda d: _edit_config(d, vocab_size=200), r"vocab_size=200 is below the tokenizer's 300 tokens"),
        (lambda d: (d / "tokenizer.json").unlink(), r"tokenizer\.json missing"),
        (lambda d: (d / "tokenizer.json").write_text("{not json"), r"not a valid tokenizer\.json"),
        (lambda d: (d / "config.json").unlink(), r"not a GLA checkpoint \(config\.json missing\)"),
        (
            lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:5000]),
            r"not a readable safetensors file, truncated\?",
        ),
        (
            lambda d: _edit_config(d, hidden_size=96),
            r"model\.embeddings\.weight has shape \[320, 64\], config\.json implies \[320, 96\]",
        ),
    ],
    ids=[
        "not-gla",
        "feature-map",
        "no-output-gate",
        "hybrid",
        "grouped-heads",
        "unknown-field",
        "shared-conv",
        "legacy-eps-disagrees",
        "vocab-below-tokenizer",
        "no-tokenizer",
        "bad-tokenizer",
        "no-config",
        "truncated",
        "mismatched-shapes",
    ],
)
def test_bad_checkpoints_exit_2_with_one_line_and_write_nothing(fla_dir, tmp_path, capsys, damage, message):
    src = _copy(fla_dir, tmp_path / "src")
    damage(src)
    status, err = _import_cli(src, tmp_path / "out", capsys)
    assert status == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("laplace import: error: ")
    assert re.search(message, err), err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_a_sharded_checkpoint_imports_and_a_bad_shard_is_named(fla_dir, imported, tmp_path, capsys):
    src = _copy(fla_dir, tmp_path / "sharded")
    tensors = load_file(str(src / "model.safetensors"))
    (src / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(src / shard), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: s for s, keys in shards.items() for k in keys}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    assert _import_cli(src, tmp_path / "out", capsys)[0] == 0
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (imported / "model.safetensors").read_bytes()
    # an index that places a tensor in a shard that does not hold it
    index["weight_map"][names[0]] = "model-00002-of-00002.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    status, err = _import_cli(src, tmp_path / "out2", capsys)
    assert status == 2 and f"does not hold '{names[0]}'" in err and not (tmp_path / "out2").exists()


def test_a_hub_id_that_is_not_downloaded_names_the_id_and_how(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    status, err = _import_cli("fla-hub/gla-1.3B-100B", tmp_path / "out", capsys)
    assert status == 2 and len(err.splitlines()) == 1
    assert "fla-hub/gla-1.3B-100B" in err and "hf download fla-hub/gla-1.3B-100B --local-dir DIR" in err
    assert not (tmp_path / "out").exists()


def test_config_mapping_follows_fla_rules():
    cfg, bos, eos = config_from_hf(
        {"model_type": "gla", "hidden_size": 2048, "num_hidden_layers": 24, "num_heads": 4, "vocab_size": 32000}
    )
    # fla's defaults: no short conv, no clamp, GatedMLP's intermediate size rule (hidden_ratio 4)
    assert cfg.use_short_conv is False and cfg.gate_clamp_min is None and cfg.ffn_dim == 5632
    assert (bos, eos) == (None, None)


# config.json of the public checkpoints as published (huggingface.co/fla-hub/gla-1.3B-100B and
# gla-2.7B-100B): written by earlier fla releases, with fields fla 0.6 no longer reads
PUBLISHED = {
    "gla-1.3B-100B": {
        "_name_or_path": "fla-hub/gla-1.3B-100B", "architectures": ["GLAForCausalLM"], "attn_mode": "fused_chunk",
        "bos_token_id": 1, "clamp_min": None, "conv_size": 4, "eos_token_id": 2, "expand_k": 0.5, "expand_v": 1,
        "fuse_cross_entropy": True, "fuse_norm": True, "hidden_act": "swish", "hidden_ratio": 4, "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": None, "max_position_embeddings": 2048, "model_type": "gla",
        "num_heads": 4, "num_hidden_layers": 24, "rms_norm_eps": 1e-06, "share_conv_kernel": True,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.39.1", "use_cache": True,
        "use_gk": True, "use_gv": False, "use_short_conv": False, "vocab_size": 32000,
    },
    "gla-2.7B-100B": {
        "_name_or_path": "fla-hub/gla-2.7B-100B", "architectures": ["GLAForCausalLM"], "attn_mode": "chunk",
        "bos_token_id": 1, "clamp_min": None, "conv_size": 4, "elementwise_affine": True, "eos_token_id": 2,
        "expand_k": 0.5, "expand_v": 1, "feature_map": None, "fuse_cross_entropy": True, "fuse_norm": True,
        "hidden_act": "swish", "hidden_ratio": 4, "hidden_size": 2560, "initializer_range": 0.02,
        "intermediate_size": None, "max_position_embeddings": 2048, "model_type": "gla", "norm_eps": 1e-06,
        "num_heads": 5, "num_hidden_layers": 32, "num_kv_heads": None, "rms_norm_eps": 1e-06,
        "share_conv_kernel": True, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.40.2", "use_cache": True, "use_gk": True, "use_gv": False,
        "use_output_gate": True, "use_short_conv": False, "vocab_size": 32000,
    },
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_the_published_checkpoints_configs_map_to_flas_own_model(name, tmp_path):
    """The full-size configs: Laplace's architecture has fla's parameter count, tensor for tensor (both
    built on the meta device). A copy cut to 2 layers of 64 (every other field as published) goes
    through fla's save_pretrained and `laplace import`, and back out to from_pretrained strictly."""
    from fla.models import GLAConfig, GLAForCausalLM
    from transformers import AutoModelForCausalLM

    from laplace.model.hf import to_fla_name

    cfg, bos, eos = config_from_hf(PUBLISHED[name])
    assert (bos, eos) == (1, 2) and cfg.gate_clamp_min is None and cfg.use_short_conv is False
    with torch.device("meta"):
        theirs = GLAForCausalLM(GLAConfig(**PUBLISHED[name])).state_dict()
        ours = LaplaceLM(dataclasses.replace(cfg, dtype="float32")).state_dict()
    assert {to_fla_name(k): tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in theirs.items()}
    print(name, sum(v.numel() for v in theirs.values()))  # the figures docs/real-models.md gives

    small = {**PUBLISHED[name], "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 320}
    small["num_heads"] = PUBLISHED[name]["num_heads"] if 32 % PUBLISHED[name]["num_heads"] == 0 else 4
    src = tmp_path / name
    GLAForCausalLM(GLAConfig(**small)).to(torch.bfloat16).save_pretrained(str(src))  # stored as published
    (src / "config.json").write_text(json.dumps(small))  # as published, not as fla 0.6 would rewrite it
    llama_style_tokenizer(src / "tokenizer.json")
    import_checkpoint(src, tmp_path / "imported")
    export_hf(tmp_path / "imported", tmp_path / "hf")
    model, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    original = load_file(str(src / "model.safetensors"))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in original.items())


# --------------------------------------------------------------------------- fine-tuning (model.init)


def _finetune_config(init: Path, tokenizer: Path, **model):
    from laplace.config import config_from_dict

    return config_from_dict(
        {
            "data": {"max_documents": 120, "num_proc": 1},
            "tokenizer": {"from": str(tokenizer)},
            "model": {"init": str(init), **model},
            "train": {
                "steps": 8,
                "batch_size": 4,
                "seq_len": 32,
                "log_every": 1,
                "eval_every": 8,
                "eval_batches": 1,
                "checkpoint_every": 8,
                "warmup_steps": 0,
                "schedule": "constant",
            },
        }
    )


def test_fine_tuning_from_an_import_starts_at_its_loss_and_lowers_it(imported, tmp_path):
    from laplace.data.sampler import sample_batch
    from laplace.data.shards import open_split, read_manifest
    from laplace.data.tokenize import tokenize_corpus
    from laplace.errors import ConfigError
    from laplace.training.loop import check_init_tokenizer, cross_entropy, run_fingerprint, train

    cfg = _finetune_config(imported, imported)  # tokenizer.from: the import's directory
    data = tmp_path / "tokenized"
    tokenize_corpus(cfg.data, cfg.tokenizer, data, cfg.seed)
    # each document as the Llama convention has it: <s> (id 1, the post-processor's) ... </s> (id 2)
    assert read_manifest(data)["eos_id"] == 2 and read_manifest(data)["document_start_ids"] == [1]
    stream = open_split(data, "train")[:]
    ends = np.flatnonzero(stream == 2)
    assert stream[0] == 1 and len(ends) > 10 and ends[-1] == len(stream) - 1
    assert (stream[ends[:-1] + 1] == 1).all() and (stream == 1).sum() == len(ends)  # one <s> after each </s>
    result = train(cfg, data, tmp_path / "run", progress=False)
    losses = [h["loss"] for h in result.history if "loss" in h]
    model = load_export(imported)[0]
    x, y = sample_batch(open_split(data, "train"), 0, 4, 32, cfg.seed, 0, 1)
    with torch.no_grad():
        expected = cross_entropy(model(x), y).item()
    assert losses[0] == pytest.approx(expected, rel=1e-5)
    assert losses[-1] < losses[0] - 0.1
    # the init's weights are part of the run's identity (so a checkpoint of another init never resumes)
    manifest = read_manifest(data)
    random_init = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init=""))
    assert run_fingerprint(cfg, cfg.model_config(), manifest) != run_fingerprint(
        random_init, cfg.model_config(), manifest
    )
    # a model.* knob that contradicts the init, and data tokenized with another tokenizer, are refused
    with pytest.raises(ConfigError, match=r"model\.d_model: 128 disagrees with model\.init"):
        _finetune_config(imported, imported / "tokenizer.json", d_model=128)
    with pytest.raises(ConfigError, match=r"model\.init: .* another tokenizer than the tokenized data's"):
        check_init_tokenizer(str(imported), {**manifest, "tokenizer_sha256": "0" * 64})


def test_import_and_hf_export_command_lines(fla_dir, tmp_path, capsys):
    assert cli.main(["import", str(fla_dir), "--out", str(tmp_path / "imp"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["parameters"] == sum(
        t.numel() for t in load_file(str(fla_dir / "model.safetensors")).values()
    )
    # without --out: models/<the source's name> under --root, the place dvc.yaml tracks for model.init
    assert cli.main(["import", str(fla_dir), "--root", str(tmp_path)]) == 0
    assert f"--set model.init={tmp_path / 'models' / fla_dir.name}" in capsys.readouterr().out
    assert (tmp_path / "models" / fla_dir.name / "model.safetensors").is_file()
    assert cli.main(["export", "--format", "hf", "--model", str(tmp_path / "imp"), "--out", str(tmp_path / "hf")]) == 0
    assert "HF / fla layout" in capsys.readouterr().out
    for name in ("config.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        assert (tmp_path / "hf" / name).is_file()
    assert read_json(tmp_path / "hf" / "generation_config.json")["eos_token_id"] == 2
    # an export that fla cannot express: one line, exit 2, nothing written
    original, _ = _laplace_export(tmp_path / "lr", gate_low_rank_dim=8)
    assert cli.main(["export", "--format", "hf", "--model", str(original), "--out", str(tmp_path / "hf2")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "laplace export: error: model.gate_low_rank_dim=8: fla's GLA fixes it at 16, so an HF export cannot carry it"
    )
    assert not (tmp_path / "hf2").exists()


def test_tokenizer_from_a_directory_without_one_is_one_line(tmp_path):
    from laplace.config import DataSection, TokenizerSection
    from laplace.data.tokenize import tokenize_corpus
    from laplace.errors import DataError

    (tmp_path / "corpus.txt").write_text(TEXT)
    (tmp_path / "empty-import").mkdir()
    with pytest.raises(DataError, match=r"^tokenizer\.from: .*empty-import is a directory without a tokenizer\.json$"):
        tokenize_corpus(
            DataSection(source="files", path=str(tmp_path / "corpus.txt"), num_proc=1),
            TokenizerSection(from_=str(tmp_path / "empty-import")),
            tmp_path / "out",
            0,
        )
    assert not (tmp_path / "out").exists()


def test_the_real_models_doc_commands_and_figures_for_the_published_checkpoints(tmp_path, capsys, monkeypatch):
    """docs/real-models.md's `laplace info` / `laplace plan` lines, as printed (in a project whose
    models/<name> holds the published config), give the figures its memory table states."""
    import shlex

    root = Path(__file__).resolve().parents[1]
    doc = (root / "docs" / "real-models.md").read_text()
    table = {row.split("|")[1].strip(): row.split("|")[2:4] for row in doc.splitlines() if row.startswith("| ")}
    shutil.copy(root / "params.yaml", tmp_path / "params.yaml")
    monkeypatch.chdir(tmp_path)
    lines = [
        line.split("#")[0].strip() for line in doc.splitlines() if line.startswith(("laplace info", "laplace plan"))
    ]
    for column, name in enumerate(sorted(PUBLISHED)):
        cfg, bos, eos = config_from_hf(PUBLISHED[name])
        (tmp_path / "models" / name).mkdir(parents=True)
        config = {"model": dataclasses.asdict(cfg), "bos_id": bos, "eos_id": eos}
        (tmp_path / "models" / name / "config.json").write_text(json.dumps(config))
        mine = [shlex.split(line)[1:] for line in lines if f"model.init=models/{name}" in line]
        assert {args[0] for args in mine} == {"info", "plan"}, (name, mine)
        printed = ""
        for args in mine:
            assert cli.main(args) == 0, args
            printed += capsys.readouterr().out
        assert f"{table['parameters'][column].strip()} (" in printed, (name, printed[:400])
        state = re.search(r"state per sequence\s+[\d,]+ bytes \(([\d.]+) MB\)", printed).group(1)
        assert table["decode state per sequence (fp32)"][column].strip() == f"{float(state):.1f} MB"
        before = re.search(r"total before activations\s+([\d.]+) GiB", printed).group(1)
        row = next(v for k, v in table.items() if k.startswith("fine-tuning on one rank"))
        assert row[column].strip() == f"{float(before):.1f} GiB", (name, before)


# --------------------------------------------------------------------------- every config.json key against fla
# Each config field of fla's GLAConfig and GatedDeltaNetConfig (the gated_deltanet importer,
# laplace/model/hf_gdn.py), and each known extra key, is set to a value other than its default, saved
# with fla's own save_pretrained, and imported with `laplace import`: the import either computes fla's
# function (logits against fla's own forward, in fp64) or is refused with one line naming the key. A
# key fla stores but never reads (gate_logit_normalizer ...) is not obeyed: fla does not obey it.

SAME, REFUSED = "computes fla's function", "refused by name"
# key -> (the config fields that set it, what the import must do): the keys both families share
COMMON_CASES = {
    "hidden_size": ({"hidden_size": 96}, SAME),
    "hidden_ratio": ({"hidden_ratio": 2}, SAME),
    "intermediate_size": ({"intermediate_size": 96}, SAME),
    "num_hidden_layers": ({"num_hidden_layers": 3}, SAME),
    "num_heads": ({"num_heads": 4}, SAME),
    "attn_mode": ({"attn_mode": "fused_recurrent"}, SAME),
    "use_short_conv": ({"use_short_conv": False}, SAME),
    "conv_size": ({"conv_size": 3}, SAME),
    "hidden_act": ({"hidden_act": "relu"}, REFUSED),
    "max_position_embeddings": ({"max_position_embeddings": 16}, SAME),
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
    # transformers' common keys, and one nobody knows
    "id2label": ({"id2label": {"0": "no", "1": "yes"}}, SAME),
    "dtype": ({"dtype": "float32"}, SAME),
    "use_rope": ({"use_rope": True}, REFUSED),
}
GLA_CASES = {
    **COMMON_CASES,
    # GLAConfig's own fields
    "expand_k": ({"expand_k": 1.0}, SAME),
    "expand_v": ({"expand_v": 0.5}, SAME),
    "num_kv_heads": ({"num_kv_heads": 1}, REFUSED),
    "feature_map": ({"feature_map": "relu"}, REFUSED),
    "use_output_gate": ({"use_output_gate": False}, REFUSED),
    "clamp_min": ({"clamp_min": -0.2}, SAME),
    "elementwise_affine": ({"elementwise_affine": False}, REFUSED),
    "use_gk": ({"use_gk": False}, SAME),  # fla 0.6 reads neither: always gk, never gv
    "use_gv": ({"use_gv": True}, SAME),
    # extra keys GLAConfig keeps (PreTrainedConfig style) and fla's layers never read
    "gate_logit_normalizer": ({"gate_logit_normalizer": 8}, SAME),
    "gate_low_rank_dim": ({"gate_low_rank_dim": 8}, REFUSED),
    "conv_bias": ({"conv_bias": True}, SAME),
    # earlier fla releases' keys (the published fla-hub checkpoints carry them)
    "rms_norm_eps": ({"rms_norm_eps": 1e-3}, REFUSED),
    "rms_norm_eps-agrees": ({"rms_norm_eps": 1e-6}, SAME),
    "share_conv_kernel": ({"share_conv_kernel": True}, REFUSED),
    "problem_type": ({"problem_type": "single_label_classification"}, SAME),
}
GDN_CASES = {
    **COMMON_CASES,
    # GatedDeltaNetConfig's own fields
    "expand_v": ({"expand_v": 1.5}, SAME),
    "use_gate": ({"use_gate": False}, REFUSED),
    "allow_neg_eigval": ({"allow_neg_eigval": True}, SAME),
    "head_dim": ({"head_dim": 8}, SAME),
    "num_v_heads": ({"num_v_heads": 4}, SAME),
    "num_v_heads-not-a-multiple": ({"num_v_heads": 3}, REFUSED),
    "output_gate_activation": ({"output_gate_activation": "sigmoid"}, REFUSED),
    # a key the gated_deltanet importer has no rule for
    "conv_bias": ({"conv_bias": True}, REFUSED),
}


@dataclasses.dataclass(frozen=True)
class Family:
    cases: dict
    config: str  # fla's config class
    save: object  # (out, **fields) -> an fla checkpoint
    logits: object  # fla_logits / fla_gdn_logits
    tokens: torch.Tensor


FAMILIES = {
    # > 64 tokens: fla's chunk mode; gates drawn strong, so a key that changes the gate shows
    "gla": Family(
        GLA_CASES,
        "GLAConfig",
        lambda out, **fields: fla_checkpoint(out, strong_gates=True, **fields),
        fla_logits,
        torch.randint(0, 300, (2, 80), generator=torch.Generator().manual_seed(0)),
    ),
    "gdn": Family(
        GDN_CASES,
        "GatedDeltaNetConfig",
        fla_gdn_checkpoint,
        fla_gdn_logits,
        torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(0)),
    ),
}
TOKENS = FAMILIES["gla"].tokens
# hybrid attention layers (`attn`) are issue 31's, tested with the hybrid models (and test_hf_gdn.py's)
ELSEWHERE = {"attn"}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_config_field_and_known_extra_key_has_a_case(family):
    import fla.models

    cases = FAMILIES[family].cases
    fields = set(inspect.signature(getattr(fla.models, FAMILIES[family].config).__init__).parameters)
    fields -= {"self", "kwargs"}
    assert fields - ELSEWHERE <= set(cases), sorted(fields - ELSEWHERE - set(cases))
    if family == "gla":
        assert set(FLA_IGNORES) | set(FLA_FIXED) <= set(cases)


def _saved_by_fla(family: Family, out: Path, fields: dict) -> Path:
    """fla builds and saves the model with `fields`; where fla itself refuses to build it, fla's
    default model is saved and config.json given the fields, as a hand-edited checkpoint would be."""
    try:
        return family.save(out, **fields)
    except (ValueError, AssertionError, KeyError, TypeError):
        family.save(out)
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, **fields}))
        return out


@pytest.mark.parametrize(
    "name, case", [(name, case) for name in sorted(FAMILIES) for case in sorted(FAMILIES[name].cases)]
)
def test_each_config_key_computes_flas_function_or_is_refused_by_name(name, case, tmp_path, capsys):
    family = FAMILIES[name]
    fields, expected = family.cases[case]
    src = _saved_by_fla(family, tmp_path / "fla", fields)
    key = next(iter(fields))
    assert key in json.loads((src / "config.json").read_text())  # fla wrote it (its configs keep extra keys)
    capsys.readouterr()  # what saving printed
    status = cli.main(["import", str(src), "--out", str(tmp_path / "imported")])
    out, err = capsys.readouterr()
    if expected == REFUSED:
        assert status == 2, out
        assert len(err.strip().splitlines()) == 1 and re.search(rf"\b{key}=", err), err
        assert not (tmp_path / "imported").exists()
        return
    assert status == 0, err
    theirs = family.logits(src, family.tokens, dtype=torch.float64)
    ours = load_export(tmp_path / "imported")[0].double()(family.tokens)
    assert (ours - theirs).abs().max() <= 1e-10 * theirs.abs().max(), case
    if name == "gla" and key in FLA_IGNORES:  # named, as not obeyed
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
