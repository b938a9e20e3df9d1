"""params.yaml is the one place for every knob; bad values fail with one line naming the key."""

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from laplace.config import Config, ModelConfig, ModelSection, default_params, knob_docs
from laplace.errors import ConfigError
from laplace.pipeline.cli import main
from laplace.pipeline.params import load_config, parse_override, parse_yaml, render_params, write_params
from laplace.pipeline.params import main as params_main
from laplace.pipeline.stages import STAGES

ROOT = Path(__file__).resolve().parents[1]


def test_params_yaml_mirrors_the_defaults_in_code():
    assert parse_yaml((ROOT / "params.yaml").read_text()) == default_params()  # read as DVC reads it


def test_every_knob_has_one_doc_and_params_yaml_comments_are_written_from_it(tmp_path):
    """The doc in code is the only one: params.yaml is exactly what `make params` writes from it."""
    docs = knob_docs()
    assert [key for key, doc in docs.items() if not doc] == []
    assert set(docs) >= {f"model.{f.name}" for f in dataclasses.fields(ModelConfig)} | {"engine", "engine.max_slots"}
    assert (ROOT / "params.yaml").read_text() == render_params()
    # a doc changed in code and not in the file is caught by --check, and `make params` fixes the file
    stale = tmp_path / "params.yaml"
    stale.write_text((ROOT / "params.yaml").read_text().replace("# epsilon of the RMS norms", "# old text"))
    assert params_main(["--check", str(stale)]) == 1
    assert params_main([str(stale)]) == 0 and params_main(["--check", str(stale)]) == 0
    assert stale.read_text() == (ROOT / "params.yaml").read_text()


def test_the_model_section_is_every_modelconfig_field():
    """A ModelConfig field is a knob without a second copy: norm_eps included (beside the preset and
    model.init, the export to fine-tune from)."""
    assert [f.name for f in dataclasses.fields(ModelSection)] == ["preset", "init"] + [
        f.name for f in dataclasses.fields(ModelConfig)
    ]
    cfg = load_config(ROOT / "params.yaml", ["model.norm_eps=1.0e-5", "model.kernel=torch"])
    assert cfg.model_config().norm_eps == 1e-5 and cfg.model_config().kernel == "torch"
    assert Config().model_config().norm_eps == ModelConfig.__dataclass_fields__["norm_eps"].default
    with pytest.raises(ConfigError, match=r"^model.norm_eps: must be > 0, got 0.0$"):
        load_config(ROOT / "params.yaml", ["model.norm_eps=0.0"])


@pytest.mark.parametrize(
    "override,message",
    [
        ("train.lrr=0.1", "unknown key 'train.lrr' (did you mean 'lr'?)"),
        ("trian.lr=0.1", "unknown key 'trian' (did you mean 'train'?)"),
        ("train.lr=fast", "train.lr: expected a number, got str 'fast'"),
        ("train.steps=0", "train.steps: must be > 0, got 0"),
        ("train.batch_size=-4", "train.batch_size: must be > 0, got -4"),
        ("train.steps=2.5", "train.steps: expected an integer, got float 2.5"),
        ("train.compile=maybe", "train.compile: expected true or false, got 'maybe'"),
        ("train.schedule=linear", "train.schedule: must be one of cosine, wsd, constant, got 'linear'"),
        ("model.preset=huge", "model.preset: unknown preset 'huge'"),
        ("model.n_heads=3", "model.n_heads: key dim d_model*expand_k=128 is not divisible by n_heads=3"),
        ("model.sub_chunk_size=48", "model.sub_chunk_size: 48 does not divide chunk_size=64"),
        ("data.val_fraction=1.5", "data.val_fraction: must be in [0, 1), got 1.5"),
        ("tokenizer.vocab_size=100", "tokenizer.vocab_size: must be >= 260"),
        ("numerics.precisions=[fp16]", "numerics.precisions: must name fp32, bf16 or both, each once"),
        ("numerics.precisions=[]", "numerics.precisions: must name fp32, bf16 or both, each once"),
        ("tokenizer.path=t.json", "'tokenizer.path' is now 'tokenizer.from': rename the key (same value)"),
    ],
)
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "params.yaml", [override])
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_overrides_apply_and_resolve_the_model():
    cfg = load_config(ROOT / "params.yaml", ["train.lr=0.01", "model.preset=small", "model.n_layers=2"])
    assert cfg.train.lr == 0.01
    m = cfg.model_config()
    assert (m.d_model, m.n_layers, m.vocab_size) == (768, 2, cfg.tokenizer.vocab_size)
    assert parse_override("generate.prompt=hello world") == (["generate", "prompt"], "hello world")


def test_a_knob_named_by_a_keyword_reads_and_writes_under_its_yaml_key(tmp_path):
    """`tokenizer.from` (a Python keyword: the field is from_) is `from` everywhere a user sees it."""
    cfg = load_config(ROOT / "params.yaml", ["tokenizer.from=models/gla"])
    assert cfg.tokenizer.from_ == "models/gla" and cfg.flat()["tokenizer.from"] == "models/gla"
    assert cfg.to_dict()["tokenizer"]["from"] == "models/gla" and "from_" not in cfg.to_dict()["tokenizer"]
    assert load_config(ROOT / "params.yaml").to_dict()["tokenizer"]["from"] == ""


def test_digest_changes_with_any_knob():
    a = load_config(ROOT / "params.yaml")
    b = load_config(ROOT / "params.yaml", ["muon.momentum=0.9"])
    assert a.digest() != b.digest() and a.digest() == load_config(ROOT / "params.yaml").digest()


def test_flat_and_digest_leave_out_the_sections_and_keys_named():
    a = load_config(ROOT / "params.yaml")
    b = load_config(ROOT / "params.yaml", ["server.port=8123", "pipeline.retries=3"])
    without = ("server.port", "pipeline")
    flat = a.flat(without=without)
    assert set(a.flat()) - set(flat) == {"server.port"} | {k for k in a.flat() if k.startswith("pipeline.")}
    assert "server.host" in flat and "pipeline.retries" in a.flat()
    assert a.digest() != b.digest() and a.digest(without=without) == b.digest(without=without)


def test_cli_reports_one_line_and_exit_code_2(capsys):
    assert main(["info", "--params", str(ROOT / "params.yaml"), "--set", "train.lrr=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "laplace info: error: unknown key 'train.lrr' (did you mean 'lr'?)"


def test_broken_yaml_is_one_line(tmp_path):
    p = tmp_path / "params.yaml"
    p.write_text("train:\n  lr: [1,\n")
    with pytest.raises(ConfigError) as err:
        load_config(p)
    assert "is not valid YAML" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "text, line",
    [
        ("seed: 1\ntrain:\n  lr: 0.1\n   steps: 3\n", 4),  # bad indentation: that line
        ("seed: 1\ntrain:\n  lr 0.1\n  steps: 3\n", 3),  # a key without its colon
        ('seed: 1\ndata:\n  hub_name: "sample\n  hub_split: train\n', 3),  # an unclosed quote
        ("seed: 1\nengine:\n  widths: [1, 2\n  max_slots: 2\n", 3),  # an unclosed bracket
    ],
)
def test_a_yaml_error_names_the_line_to_fix(tmp_path, text, line):
    params = tmp_path / "params.yaml"
    params.write_text(text)
    with pytest.raises(ConfigError, match=rf"params\.yaml: line {line} is not valid YAML"):
        load_config(params)


def test_1e3_is_a_number_through_set_and_params_yaml_as_dvc_reads_it(tmp_path, capsys):
    """YAML 1.2 (ruamel, DVC's reader): `1e-3` is 0.001 in an override and in params.yaml."""
    from dvc.utils.serialize import load_yaml

    assert load_config(ROOT / "params.yaml", ["train.lr=1e-3"]).train.lr == 0.001
    params = tmp_path / "params.yaml"
    params.write_text("train:\n  lr: 1e-3\nmuon:\n  eps: 1e-7\n")
    cfg = load_config(params)
    assert cfg.train.lr == 0.001 and cfg.muon.eps == 1e-7
    assert load_yaml(params)["train"]["lr"] == cfg.train.lr  # what dvc params/exp show read
    assert main(["info", "--params", str(params), "--set", "adamw.eps=1e-9"]) == 0
    write_params(params, ["train.lr=2e-3"])  # laplace run --set: written as the number
    assert load_yaml(params)["train"]["lr"] == 0.002 == load_config(params).train.lr


def test_an_unsorted_or_too_wide_width_ladder_is_one_line(capsys):
    assert main(["info", "--params", str(ROOT / "params.yaml"), "--set", "engine.widths=[3,1,20]"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (
        "laplace info: error: engine.widths: must increase strictly from >= 1 to max_slots=8 "
        "(e.g. [1, 2, 4, 8]), got [3, 1, 20]"
    )
    assert load_config(ROOT / "params.yaml", ["engine.widths=[1,3,8]"]).engine.widths == [1, 3, 8]


def test_the_width_ladder_has_one_rule_in_one_place():
    """[1, 4, 16] with max_slots 8 was refused by the config and accepted by the engine: now
    both use config.width_ladder, and no other module words an engine.widths error."""
    from laplace.config import width_ladder

    with pytest.raises(ConfigError, match="engine.widths: must increase strictly"):
        load_config(ROOT / "params.yaml", ["engine.widths=[1,4,16]", "engine.max_slots=8"])
    with pytest.raises(ConfigError, match="engine.widths: must increase strictly"):
        width_ladder(8, [1, 4, 16])
    assert width_ladder(8, [1, 4, 8]) == [1, 4, 8] and width_ladder(8) == [1, 2, 4, 8]
    home = Path(inspect.getsourcefile(width_ladder))  # laplace/config/serving.py, beside the engine.widths knob
    elsewhere = [
        str(p.relative_to(ROOT))
        for p in sorted((ROOT / "laplace").rglob("*.py"))
        if p != home and re.search(r"engine\.widths: |def width_ladder", p.read_text(encoding="utf-8"))
    ]
    assert elsewhere == []


def test_summary_and_generate_before_any_run_say_what_to_run(tmp_path, capsys):
    assert main(["summary", "--params", str(ROOT / "params.yaml"), "--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err == f"laplace summary: error: no pipeline run in {tmp_path} yet (no metrics/*.json): run `laplace run` first"
    )
    assert main(["generate", "--params", str(ROOT / "params.yaml"), "--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"laplace generate: error: no exported model in {tmp_path / 'artifacts' / 'export'} yet")
    assert "`laplace run`" in err and "\n" not in err


def test_every_stage_help_says_what_it_does_reads_and_writes(capsys):
    dvc = parse_yaml((ROOT / "dvc.yaml").read_text())["stages"]
    for name in STAGES:
        with pytest.raises(SystemExit):
            main([name, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        doc = STAGES[name].module.__doc__
        assert " ".join(doc.split()[:8]) in text, (name, text)  # what the stage does
        reads = text.split("params read (params.yaml): ")[1].split(" writes: ")[0]
        for param in dvc[name].get("params", []):
            assert (param if isinstance(param, str) else "every param") in reads, (name, reads)
        for out in dvc[name].get("outs", []):
            assert (out if isinstance(out, str) else next(iter(out))) in text.split(" writes: ")[1], (name, text)


# --------------------------------------------------------------------------- words that name knobs

# `--set section.key=...` or `set section.key` in a message or a doc: a suggestion to the user.
SET_SUGGESTION = re.compile(r"(?:--set[ =]|\bset )`?([a-z_]+)\.([a-z_]+)\b")
# What the project shows to users: messages in the code, the docs, the front doors' files.
SHOWN_FILES = ("laplace/**/*.py", "flows/*.py", "bench/*.py", "docs/*.md", "README.md", "Makefile", "*.yaml")


def set_suggestions(text: str) -> set[str]:
    """The keys a text suggests setting, less those it shows being refused (`unknown key 'k'`: the
    README's example of a typo) and placeholders (`--set section.key=value`)."""
    keys = {f"{a}.{b}" for a, b in SET_SUGGESTION.findall(text) if a != "section"}
    return {k for k in keys if f"unknown key '{k}'" not in text}


def test_every_suggested_set_is_a_key_the_config_accepts():
    """A message that says `set serve.threads` (refused since server: took it) sends the user to an
    error: every key suggested anywhere is a knob of the config."""
    knobs = set(knob_docs())
    found = {
        (str(path.relative_to(ROOT)), key)
        for pattern in SHOWN_FILES
        for path in sorted(ROOT.glob(pattern))
        for key in set_suggestions(path.read_text(encoding="utf-8"))
    }
    assert len(found) > 20  # the collector sees the suggestions there are (README, docs, messages)
    assert sorted(f"{path}: {key}" for path, key in found if key not in knobs) == []


def test_the_set_collector_sees_messages_and_docs():
    text = "rerun with --set train.lr=0.1, or set serve.threads as warmup had it; `--set section.key=value`"
    assert set_suggestions(text) == {"train.lr", "serve.threads"}
    assert set_suggestions("laplace train --set train.lrr=0.01\nerror: unknown key 'train.lrr'") == set()
    assert "serve.threads" not in knob_docs() and "server.threads" in knob_docs()


def test_the_docs_name_every_section_and_stage_in_order():
    """docs/model.md and docs/architecture.md list params.yaml's sections, docs/pipeline.md the
    stage order: each list as the code has it."""
    sections = [f.name for f in dataclasses.fields(Config) if f.default_factory is not dataclasses.MISSING]
    for doc, lead in (("docs/model.md", "Sections:"), ("docs/architecture.md", "in sections by owner (")):
        text = " ".join((ROOT / doc).read_text(encoding="utf-8").split())
        listed = re.findall(r"`([a-z_]+)`", text.split(lead, 1)[1].split(".", 1)[0].split(")", 1)[0])
        assert listed == sections, doc
    text = " ".join((ROOT / "docs/pipeline.md").read_text(encoding="utf-8").split())
    order = text.split("The order is ", 1)[1].split(" (", 1)[0].split(" -> ")
    assert order == list(STAGES)
