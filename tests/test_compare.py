"""The architecture comparison (laplace.pipeline.compare, compare/dvc.yaml): arms as configs, the
table's rules, and the engine's bytes and decode time against context for each architecture."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from laplace.config import config_from_dict
from laplace.errors import ConfigError
from laplace.model.config import architecture_family
from laplace.pipeline import compare, compare_table

from project import PIPELINE_TIMEOUT_S


def test_every_default_arm_is_a_valid_config_of_its_family():
    cfg = config_from_dict({})
    arms = compare.check_arms(cfg)
    families = {arm: architecture_family(c.model_config()) for arm, c in arms.items()}
    assert families == {
        "gla": "gla",
        "hybrid-1in4": "hybrid",
        "hybrid-1in2": "hybrid",
        "softmax": "softmax",
        "gdn": "gated_deltanet",
        "gdn-hybrid": "hybrid",
    }
    layers = {arm: (c.model_config().attn_layers, c.model_config().gdn_layers) for arm, c in arms.items()}
    assert layers == {
        "gla": ((), ()),
        "hybrid-1in4": ((3,), ()),
        "hybrid-1in2": ((1, 3), ()),
        "softmax": ((0, 1, 2, 3), ()),
        "gdn": ((), (0, 1, 2, 3)),
        "gdn-hybrid": ((3,), (0, 1, 2)),  # hybrid-1in4's attention layer, Gated DeltaNet in GLA's place
    }
    # the shared settings are the same for every arm: only model.* differs
    shared = {arm: {k: v for k, v in c.to_dict().items() if k not in ("model", "compare")} for arm, c in arms.items()}
    assert all(s == shared["gla"] for s in shared.values())
    assert all(c.train.steps == cfg.compare.overrides["train.steps"] for c in arms.values())


def test_a_gla_arm_does_not_inherit_the_main_pipelines_attention_layers():
    cfg = config_from_dict({"model": {"preset": "tiny-hybrid"}})
    assert cfg.model_config().attn_layers == (3,)
    assert compare.arm_config(cfg, "gla").model_config().attn_layers == ()


@pytest.mark.parametrize(
    ("arms", "message"),
    [
        ({"x": {"d_modell": 64}}, "compare.arms.x.d_modell: not a model.* knob"),
        ({"x": {"attn": {"layers": [9], "num_heads": 4}}}, "compare.arms.x.model.attn"),
        ({"x": {"preset": "tiny", "n_heads": 3}}, "compare.arms.x.model.n_heads"),
        ({"bad name": {}}, "compare.arms"),
    ],
)
def test_a_bad_arm_is_one_line_naming_it(arms, message):
    with pytest.raises(ConfigError) as exc:
        compare.check_arms(config_from_dict({"compare": {"arms": arms}}))
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_a_table_column_that_was_never_measured_is_refused():
    cfg = config_from_dict({"compare": {"decode_contexts": [1024, 8192], "table_contexts": [2048, 8192]}})
    with pytest.raises(ConfigError, match=r"compare.table_contexts: \[2048\] not in compare.decode_contexts"):
        compare.check_arms(cfg)


def test_the_3b_shape_and_its_hybrids_from_the_formula():
    """At 8k tokens in bf16: the article's 2.4 GB K/V against laplace-3b's fixed state is the article's
    82x; each hybrid's ratio is computed from its layers, and more attention layers hold more."""
    from laplace.model.config import preset_model_config
    from laplace.model.lm import sequence_bytes

    big = compare_table.laplace_3b_bytes(8192)
    gla = big["presets"]["laplace-3b"]
    assert gla["bytes"] == sequence_bytes(preset_model_config("laplace-3b"), 8192)["total_bytes"]
    assert big["article_kv_cache_bytes"] == pytest.approx(2.416e9, rel=1e-3)  # 2 x 24 x 8192 x 3072 x 2
    assert gla["article_kv_over_this"] == pytest.approx(82, rel=0.02)
    order = ["laplace-3b", "laplace-3b-hybrid-24to1", "laplace-3b-hybrid-7to1", "laplace-3b-hybrid-3to1"]
    ratios = [big["presets"][n]["attention_over_this"] for n in order + ["laplace-3b-attn"]]
    assert ratios == sorted(ratios, reverse=True) and ratios[-1] == 1.0


def test_ruler_columns_are_the_mean_over_the_tasks_that_ran_and_the_rest_are_named_with_their_reason():
    from laplace.tracking.compare import arm_metrics

    ruler = {
        "niah_single_1": {"run": True, "score": {"1024": 0.5}, "samples": 4},
        "ruler_vt": {"run": True, "score": {"1024": 0.0}, "samples": 4},
        "ruler_fwe": {"run": False, "reason": "did not finish in 600 s"},
    }
    figures = {
        "train": {"val_loss": 5.0},
        "probes": {},
        "export": {"parameters": 10},
        compare_table.ARCH_FIGURES: {"family": "gla", "ruler": ruler},
    }
    row = compare_table.table_row("gla", figures, [])
    assert row["ruler"] == {"1024": 0.25}  # (0.5 + 0.0) / 2: the task that did not run is not a zero
    assert row["ruler_not_run"] == {"ruler_fwe": "did not finish in 600 s"}
    metrics = arm_metrics(row)
    assert metrics["ruler_1024"] == 0.25 and metrics["ruler_niah_single_1_1024"] == 0.5
    assert "ruler_ruler_fwe_1024" not in metrics
    table = {
        "arms": {"gla": row | {"recall": {}, "bytes_per_sequence": {}}},
        "mqar": PROTOCOL,
        "memory_context": 8192,
        "headline": "h",
        "pick": {"arm": "gla", "reason": "r"},
    }
    text = compare_table.format_table(table, [])
    assert "ruler@1024" in text.splitlines()[0] and "0.25" in text.splitlines()[1]
    assert "ruler       ruler_fwe not run on gla: did not finish in 600 s" in text


# one model of a protocol summary, as laplace.pipeline.compare_mqar writes it (the table's printout needs one)
PROTOCOL = {
    "models": {
        "gla-w64": {
            "arm": "gla",
            "width": 64,
            "family": "gla",
            "best_lr": 0.005,
            "bytes_per_sequence": {"64": 11264},
            "accuracy": {"64": {"16": {"mean": 0.5, "se": 0.1, "seeds": [0.4, 0.5, 0.6], "queries": 1008}}},
        }
    },
    "gate": {"passed": False, "checks": [], "reason": "r"},
    "reference": {"context": 64, "pairs": 16},
    "significance_se": 2.0,
}


def test_lm_recall_columns_where_every_arm_is_at_chance_are_marked_not_informative():
    def row(verdict_256, ruler):
        return {
            "recall": {"256": 0.0, "1024": 0.0},
            "recall_verdict": {"256": verdict_256, "1024": "recall: none above chance"},
            "ruler": {"1024": ruler},
        }

    rows = {"gla": row("recall: none above chance", 0.0), "softmax": row("recall above chance: passkey", 0.0)}
    muted = compare_table.uninformative_columns(rows, 70)
    # 256: one arm recalls, so the column compares something; 1024 and RULER: nothing anywhere
    assert muted == {
        "recall@1024": "no arm above chance after 70 training steps",
        "ruler@1024": "every arm scored 0 after 70 training steps",
    }
    rows["gla"]["ruler"]["1024"] = 0.25
    assert "ruler@1024" not in compare_table.uninformative_columns(rows, 70)


# --------------------------------------------------------------------------- decode time against context


def _random_export(out, tokenizer, attn):
    """A random 4-layer model at width 512 (decode cost is the attention's K/V reads, not Python;
    with 3 such runs at once on 2 cores, 256 -> 8,192 tokens: GLA 0.99-1.02x, softmax 4.1-4.5x)."""
    from laplace.model.config import ModelConfig
    from laplace.model.lm import LaplaceLM

    from project import write_model_export

    torch.manual_seed(0)
    model = LaplaceLM(ModelConfig(vocab_size=512, d_model=512, n_layers=4, n_heads=4, attn=attn))
    return write_model_export(model, tokenizer, out, eos_id=0)


def test_decode_time_reports_each_context_and_its_ratio(tiny_artifacts, tmp_path):
    """laplace.evals.architectures.decode_time, the comparison's measurement, on a pure GLA and an
    all-attention model: a time per decoded token at each context and the ratio of the longest to
    the shortest. No claim on the times themselves (no test depends on the machine's speed): that
    softmax's grows with the context and GLA's stays flat is bench/decode.py's (bench/RESULTS.md)
    and the comparison's own run's (docs/architectures.md)."""
    import math

    from laplace.evals.architectures import decode_time

    data_dir, _ = tiny_artifacts
    tokenizer = data_dir / "tokenizer.json"
    cfg = config_from_dict({"engine": {"device": "cpu"}})
    text = list(range(3, 300))
    for attn in (None, {"layers": [0, 1, 2, 3], "num_heads": 4}):
        export = _random_export(tmp_path / ("softmax" if attn else "gla"), tokenizer, attn)
        figures = decode_time(cfg, export, [64, 256], 2, text, torch.device("cpu"))
        ms = figures["decode_ms_per_token"]
        assert set(ms) == {"64", "256"} and all(math.isfinite(v) and v > 0 for v in ms.values()), figures
        assert figures["decode_ratio_longest_vs_shortest"] == ms["256"] / ms["64"]


# --------------------------------------------------------------------------- end to end through DVC

# one arm at the tests' tiny size (one layer, a few steps), then a second added: the table of both is
# what the rows are checked on. Each arm's warmup cold-compiles its 2 serving graphs (~45 CPU-s): a
# third arm would prove nothing these two do not. The fixture (both runs) sets up under each test's
# pipeline limit (fixtures included): 600 s was passed at load 6 on 2 cores
FIRST_ARMS = {"gla": {"preset": "tiny"}}
ADDED_ARM = {"softmax": {"preset": "tiny", "attn": {"layers": [0], "num_heads": 2}}}
E2E_OVERRIDES = {
    "train.steps": 4,
    "train.eval_every": 2,
    "train.checkpoint_every": 2,
    "serve_check.workloads": ["poisson"],
    "serve_check.requests": 6,
    "probes.train_mqar": False,
    "probes.memory_contexts": [128],
}
# the MQAR protocol at a size that trains in a second per cell: one width, so its gate cannot pass
# (GLA's rise with width is not measured) and the table must say recall was not measured
E2E_MQAR = {
    "mqar.arms": list(FIRST_ARMS),
    "mqar.widths": [16],
    "mqar.lrs": [0.01],
    "mqar.vocab": 32,
    "mqar.seq_len": 16,
    "mqar.train_pairs": 2,
    "mqar.contexts": [16],
    "mqar.pairs": [1, 2],
    "mqar.reference_pairs": 2,
    "mqar.steps": 10,
    "mqar.batch_size": 8,
    "mqar.test_queries": 1000,
}


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """`make compare` on FIRST_ARMS, then ADDED_ARM written into params.yaml and `dvc repro` in
    compare/: the repository, both runs' output and compare/'s `dvc status` between them."""
    from project import ROOT, TINY_PARAMS, commit_all, copy_project, run, set_params

    repo = copy_project(
        tmp_path_factory.mktemp("compare"),
        {
            **TINY_PARAMS,
            # one slot: each arm's warmup compiles 2 graphs, not 3 (decode width 1, prefill 64), ~20 CPU-s
            # less per arm; the arms' figures use one slot anyway (laplace/evals/architectures.py)
            "engine.max_slots": 1,
            "engine.max_context": 1024,
            "compare.arms": FIRST_ARMS,
            "compare.overrides": E2E_OVERRIDES,
            "compare.memory_contexts": [256, 1024],
            "compare.decode_contexts": [64, 512],
            "compare.decode_timing_steps": 4,
            "compare.table_contexts": [64, 512],
            "compare.lm_eval_tasks": [],
            **E2E_MQAR,
        },
    )
    # `make compare` as the README prints it (the project's shards, then compare/'s own `dvc repro`),
    # on this checkout's venv, already set up
    venv = Path(sys.executable).parent.parent
    make = ["make", "-f", str(ROOT / "Makefile"), f"VENV={venv}", "-o", f"{venv}/.installed", "-o", f"{venv}/.runtime"]
    out = run([*make, "compare"], repo, timeout=1500)
    status = run(["python", "-m", "dvc", "status"], repo / "compare").stdout
    commit_all(repo, "the comparison")
    added = {f"compare.arms.{name}": arm for name, arm in ADDED_ARM.items()}
    set_params(repo / "params.yaml", {**added, "mqar.arms": [*FIRST_ARMS, *ADDED_ARM]})
    again = run(["python", "-m", "dvc", "repro"], repo / "compare", timeout=1500).stdout
    return repo, out.stdout + out.stderr, status, again


def _ran(output: str) -> set[str]:
    return {line.split("'")[1] for line in output.splitlines() if line.startswith("Running stage '")}


def _cells(arm: str) -> set[str]:
    return {f"cell@{arm}-16-0.01-{s}" for s in (0, 1, 2)}


@pytest.mark.slow
@pytest.mark.timeout(PIPELINE_TIMEOUT_S)
def test_the_comparison_runs_through_dvc_and_adding_an_arm_reruns_only_that_arm(compared):
    from project import BIN, run

    repo, first, first_status, again = compared
    assert _ran(first) >= {"tokenize", "arm@gla", "mqar", "table"} | _cells("gla")
    assert "up to date" in first_status, first_status
    # the new arm, its protocol cells, the protocol's summary and the table: nothing finished reruns
    assert _ran(again) == {"arm@softmax", "mqar", "table"} | _cells("softmax"), again
    status = run(["python", "-m", "dvc", "status"], repo / "compare")
    assert "up to date" in status.stdout, status.stdout
    # the project's own DVC view never lists the comparison (compare/ is a repository of its own)
    project = run(["python", "-m", "dvc", "status"], repo).stdout
    listed = {line.rstrip(":") for line in project.splitlines() if line and not line.startswith(("\t", " "))}
    assert listed and not any(name.startswith(("arm@", "table", "tokenize", "corpus")) for name in listed), project
    table = json.loads((repo / "compare" / "table.json").read_text())
    assert set(table["arms"]) == {"gla", "softmax"}
    gla, soft = table["arms"]["gla"], table["arms"]["softmax"]
    assert (gla["family"], soft["family"]) == ("gla", "softmax")
    assert gla["val_loss"] > 0 and soft["val_loss"] > 0
    # every arm served the workload with no compile, measured its bytes as the formula says
    for row in (gla, soft):
        assert row["compiles_while_serving"] == 0
        assert row["bytes_per_sequence"] == row["bytes_per_sequence_formula"]
    # a GLA's state is the same at every length; a softmax model (no GLA layer) holds only K/V, which
    # grows with the context: 2 (K, V) x 1 layer x tokens x 32 (2 heads x 16) x 4 bytes
    assert gla["bytes_per_sequence"]["256"] == gla["bytes_per_sequence"]["1024"] > 0
    assert soft["bytes_per_sequence"] == {"256": 2 * 256 * 32 * 4, "1024": 2 * 1024 * 32 * 4}
    # one width: the protocol's gate fails on GLA's rise with width, so recall draws no pick or headline
    gate = table["mqar"]["gate"]
    assert not gate["passed"] and "GLA rises with width: failed, needs pure GLA at two widths" in gate["reason"]
    assert table["pick"]["arm"] is None and table["pick"]["reason"].startswith("recall not measured: ")
    assert table["headline"].startswith("recall not measured: ")
    assert set(table["arms"]["gla"]["mqar"]) == {"gla-w16"}
    # the docs' commands (docs/architectures.md), as printed
    shown = run([str(BIN / "laplace"), "compare", "--no-track"], repo)
    assert "pick" in shown.stdout and "gla" in shown.stdout and "softmax" in shown.stdout
    assert "pick        none: recall not measured" in shown.stdout and "gate        FAILED" in shown.stdout
    protocol = run([str(BIN / "laplace"), "mqar"], repo).stdout
    assert "gla-w16" in protocol and "FAIL GLA rises with width" in protocol, protocol
    metrics = run(["python", "-m", "dvc", "metrics", "show"], repo / "compare")
    assert "table.json" in metrics.stdout
    run(["python", "-m", "dvc", "plots", "show"], repo / "compare")
    assert (repo / "compare" / "dvc_plots" / "index.html").exists()


@pytest.mark.slow
@pytest.mark.timeout(PIPELINE_TIMEOUT_S)
def test_mlflow_holds_one_parent_and_a_child_per_arm_with_the_tables_figures(compared):
    from mlflow import MlflowClient

    repo = compared[0]
    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("laplace-compare")
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 2  # one per `table` run: the first comparison, then the one with the added arm
    parent = max(parents, key=lambda r: r.info.start_time)  # the latest: table.json's
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    table = json.loads((repo / "compare" / "table.json").read_text())
    by_arm = {r.data.params["arm"]: r for r in children}
    assert set(by_arm) == set(table["arms"]) and len(children) == 2
    for arm, child in by_arm.items():
        assert child.data.metrics["val_loss"] == pytest.approx(table["arms"][arm]["val_loss"])
        assert parent.data.metrics[f"{arm}.val_loss"] == pytest.approx(table["arms"][arm]["val_loss"])
    # one registered model per family, each version's reason saying why
    for family in ("gla", "softmax"):
        versions = client.search_model_versions(f"name='laplace-compare-{family}'")
        assert versions, family


@pytest.mark.slow
@pytest.mark.timeout(PIPELINE_TIMEOUT_S)
def test_the_prefect_flow_fans_out_one_task_per_arm_and_reruns_nothing_finished(compared, tmp_path):
    """flows/compare.py (the laplace-compare deployments' entrypoint) run once, no server: a task per
    arm, each `dvc repro --single-item` in compare/, all of them already up to date."""
    from project import direct_flow_env, run

    repo = compared[0]
    out = run(["python", "flows/compare.py"], repo, env=direct_flow_env(tmp_path), timeout=900)
    log = out.stdout + out.stderr
    result = json.loads(out.stdout[out.stdout.index("{") :])
    table = json.loads((repo / "compare" / "table.json").read_text())
    assert sorted(result["arms"]) == sorted(table["arms"]) == ["gla", "softmax"] and result["pick"] == table["pick"]
    for arm in table["arms"]:
        assert f"stage-arm@{arm}" in log and f"'arm@{arm}' didn't change" in log, (arm, log[-3000:])
    assert "Running stage" not in log, log[-3000:]
