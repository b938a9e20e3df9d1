"""The pipeline frame: dvc.yaml, the stage registry and the flow agree; bad params stop everything
before any stage runs; params overrides keep the file's comments; retries skip bad input."""

import difflib
import json
import re

import pytest
import yaml

from laplace.config import Config
from laplace.errors import ConfigError
from laplace.pipeline import cli, repro
from laplace.pipeline.params import write_params
from laplace.pipeline.stages import PIPELINE, STAGES

from project import ROOT, TINY_PARAMS, copy_project, run

ORDER = ["corpus", "tokenize", "warmup", "train", "export", "serve-check", "numerics", "probes", "track"]


def test_dvc_yaml_matches_the_stage_registry():
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    assert list(stages) == list(PIPELINE)
    assert list(PIPELINE) == [s for s in ORDER if s in PIPELINE]  # the pipeline's order, absent stages skipped
    sections = {f.name for f in Config.__dataclass_fields__.values()}
    for name, stage in stages.items():
        assert stage["cmd"] == f"laplace {name}"
        for p in stage.get("params", []):
            key = next(iter(p)) if isinstance(p, dict) else p
            assert key == "params.yaml" or key.split(".")[0] in sections, (name, key)
        outs = [next(iter(o)) if isinstance(o, dict) else o for o in stage.get("outs", [])]
        if STAGES[name].metrics:  # every figure: a plain output, out of `dvc metrics show`'s default view
            assert f"metrics/{STAGES[name].metrics}.json" in outs
    # the one DVC metrics file: the headline, written by track
    assert [next(iter(m)) for s in stages.values() for m in s.get("metrics", [])] == ["metrics.json"]


def test_each_stage_has_one_name_module_cli_and_metrics_file():
    """serve-check is laplace.pipeline.stage_serve_check, `laplace serve-check`, metrics/serve-check.json;
    every stage module is registered, by reference."""
    modules = sorted(p.stem for p in (ROOT / "laplace" / "pipeline").glob("stage_*.py"))
    assert sorted(s.module.__name__.rsplit(".", 1)[1] for s in STAGES.values()) == modules
    for name, stage in STAGES.items():
        assert stage.module.__name__ == f"laplace.pipeline.stage_{name.replace('-', '_')}"
        assert stage.metrics in (name, None) and (stage.metrics is None) == (name == "track")
    commands = set(cli.build_parser()._subparsers._group_actions[0].choices)
    assert set(STAGES) <= commands


def test_the_registry_imports_no_torch():
    """Every `laplace` command and the Prefect flow import the registry: its stages import their
    heavy parts when they run, so `laplace --help` does not wait for torch."""
    code = "import sys, laplace.pipeline.cli, laplace.pipeline.stages; print('torch' in sys.modules)"
    assert run(["python", "-c", code], ROOT).stdout.strip() == "False"


def test_write_params_validates_first_and_keeps_comments(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text((ROOT / "params.yaml").read_text())
    before = params.read_text()
    with pytest.raises(ConfigError, match="unknown key 'train.lrr'"):
        write_params(params, ["train.lrr=0.1"])
    assert params.read_text() == before  # nothing written
    assert write_params(params, {"train.lr": 0.01, "model.preset": "tiny"}) is True
    text = params.read_text()
    assert "# Laplace pipeline parameters" in text and "lr: 0.01" in text
    assert yaml.safe_load(text)["train"]["lr"] == 0.01
    assert write_params(params, {"train.lr": 0.01}) is False


def changed_lines(before: str, after: str) -> list[str]:
    return [
        line
        for line in difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="", n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]


def test_one_value_set_by_dvc_exp_run_or_laplace_is_a_one_line_diff(tmp_path):
    """`dvc exp run --set-param` rewrites params.yaml through DVC's own writer (Hydra overrides
    applied with ruamel.yaml); params.yaml is laid out the way that writer writes it, so a
    one-value change is a one-line diff. The same holds for `laplace run --set` and the Prefect
    flow's overrides (write_params), lists included."""
    from dvc.utils.hydra import apply_overrides  # what `dvc exp run --set-param` calls

    params = tmp_path / "params.yaml"
    before = (ROOT / "params.yaml").read_text()
    params.write_text(before)
    apply_overrides(params, ["train.lr=0.001"])
    assert changed_lines(before, params.read_text()) == [
        "-  lr: 0.003                  # AdamW learning rate (embeddings, head, norms, biases)",
        "+  lr: 0.001                  # AdamW learning rate (embeddings, head, norms, biases)",
    ]
    params.write_text(before)
    assert write_params(params, ["train.lr=0.001", "model.preset=tiny"]) is True
    assert len(changed_lines(before, params.read_text())) == 2
    params.write_text(before)
    write_params(params, {"engine.prefill_buckets": [64]})
    assert changed_lines(before, params.read_text()) == ["-  - 256"]


def test_stage_exit_status_is_read_from_dvc_output():
    tail = "ERROR: failed to reproduce 'train': failed to run: laplace train, exited with 2"
    assert repro.stage_exit_status(255, tail) == 2
    assert repro.stage_exit_status(1, "something else") == 1


def test_retries_skip_rejected_input():
    from prefect.states import Failed

    from flows.pipeline import StageFailed, StageRejected, retry_transient

    assert retry_transient(None, None, Failed(data=StageFailed("killed"))) is True
    assert retry_transient(None, None, Failed(data=StageRejected("bad params"))) is False


@pytest.mark.slow
def test_bad_params_stop_dvc_repro_and_laplace_run_before_any_work(tmp_path):
    repo = copy_project(tmp_path / "p", TINY_PARAMS)
    out = run(["laplace", "run", "--set", "train.lrr=1"], repo, check=False)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == "laplace run: error: unknown key 'train.lrr' (did you mean 'lr'?)"
    params = repo / "params.yaml"
    text, bad = params.read_text(), re.compile(r"^  steps: 6\b", re.M)  # the line keeps its comment
    assert bad.search(text), "train.steps is not 6 in the copied params.yaml"
    params.write_text(bad.sub("  steps: many", text, count=1))
    out = run(["python", "-m", "dvc", "repro"], repo, check=False)
    assert out.returncode != 0
    assert "train.steps: expected an integer, got str 'many'" in out.stdout + out.stderr
    assert not (repo / "data" / "tokenized" / "manifest.json").exists()
    assert not (repo / "runs").exists()


def test_coinciding_plot_series_are_drawn_once_and_named_together():
    from laplace.pipeline.plots import series_rows

    rows = series_rows(
        {"depth 0.1": {128: 0.0, 256: 0.0}, "depth 0.5": {128: 0.0, 256: 0.0}, "depth 0.9": {128: 0.5, 256: 0.0}},
        x="context",
        y="accuracy",
        chance=1 / 90_000,
    )
    assert {r["series"] for r in rows} == {"depth 0.1 = depth 0.5 = chance", "depth 0.9"}
    assert [r["order"] for r in rows] == [0, 0, 1, 1] and len(rows) == 4


def test_the_flow_drops_dvcs_git_hint_after_each_stage():
    from laplace.pipeline.repro import WithoutGitHints

    seen = []
    hint = ["To track the changes with git, run:", "\tgit add dvc.lock", "To enable auto staging, run:"]
    drop = WithoutGitHints(seen.append)
    for line in ["Running stage 'train':", *hint, "\tdvc config core.autostage true", "done"]:
        drop(line)
    assert seen == ["Running stage 'train':", "done"]


def test_the_headline_view_puts_the_figures_and_the_varied_params_first():
    import json

    from laplace.tracking.views import headline_view, varied_params

    shown = varied_params({"train.lr": "0.001", "seed": "1"}, [{"train.lr": "0.003", "seed": "1"}])
    assert shown == ["train.lr"]
    assert varied_params({"train.lr": "0.001"}, []) == ["train.lr", "train.steps", "model.preset"]
    state = json.loads(json.loads(headline_view(None, shown))["state"])
    first = ["metrics.`eval_loss`", "metrics.`train_loss`", "metrics.`tps`", "metrics.`ttft_p99`", "params.`train.lr`"]
    assert state["columnOrder"][:5] == first and state["selectedColumns"][:5] == first
    assert all(state["columnWidths"][c] <= 92 for c in first)  # they fit beside MLflow's side panel at 1,440 px
    assert not any("gate_" in c for c in state["selectedColumns"])


# One knob of each section that the serve: split and the model section touched, and exactly the
# stages that read it (track logs every knob of the run, so it reads all but NOT_THE_RUN).
KNOB_READERS = {
    "engine.max_slots": {"warmup", "serve-check", "numerics", "probes", "track"},
    "server.port": set(),  # only `laplace serve` reads the address: no stage, no MLflow param (NOT_THE_RUN)
    # in Inductor's cache key: warmup compiles with it, and the stages that run its graphs use it
    "server.threads": {"warmup", "serve-check", "numerics", "probes", "track"},
    "serve_check.rate": {"serve-check", "track"},
    "model.norm_eps": {"warmup", "train", "track"},
    "model.kernel": {"warmup", "train", "serve-check", "probes", "track"},
}


def test_changing_a_knob_makes_dvc_rerun_exactly_the_stages_that_read_it(tmp_path):
    """A real git + DVC repo with this dvc.yaml's params and params.yaml, each stage's command
    reduced to `true` (its code and data deps are not the point): after a repro, `dvc status`
    after changing one knob lists exactly the stages that read it (the params check in
    tests/test_layout.py holds each stage's declared params to the code's reads)."""
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    stub = {name: {"cmd": "true", "params": stage["params"]} for name, stage in stages.items() if "params" in stage}
    assert set(stages) - set(stub) == {"corpus"}  # reads no knob
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": stub}, sort_keys=False))
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    run(["git", "init", "-q", "-b", "main"], tmp_path)
    run(["python", "-m", "dvc", "init", "-q"], tmp_path)
    run(["python", "-m", "dvc", "repro", "-q"], tmp_path)
    values = {"engine.max_slots": 4, "server.port": 8001, "server.threads": 2, "serve_check.rate": 5.0}
    values |= {"model.norm_eps": 1.0e-5, "model.kernel": "torch"}
    assert set(values) == set(KNOB_READERS)
    for key, value in values.items():
        write_params(tmp_path / "params.yaml", {key: value})
        status = json.loads(run(["python", "-m", "dvc", "status", "--json"], tmp_path).stdout)
        assert set(status) == KNOB_READERS[key], key
        (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
