"""End to end through DVC in a temporary clone: the main job (`laplace run`), no-op repro, a params
change as an experiment compared with the committed baseline (metrics, exp show, plots at 80
columns), offline plots, push/pull, and the MLflow runs with their registered pyfunc models, the
champion rule and the figures labelled with the run that measured them."""

import json
import shutil
from datetime import datetime

import mlflow
import pandas as pd
import pytest
import yaml
from mlflow import MlflowClient

from project import BIN, TINY_PARAMS, commit_all, copy_project, env, run

pytestmark = pytest.mark.slow

DVC = ["python", "-m", "dvc"]


def ran_stages(output: str) -> set[str]:
    return {line.split("'")[1] for line in output.splitlines() if line.startswith("Running stage '")}


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return copy_project(tmp_path_factory.mktemp("laplace"), TINY_PARAMS)


@pytest.fixture(scope="module")
def first_run(repo):
    out = run([str(BIN / "laplace"), "run"], repo)  # the main job: dvc repro, then the summary
    return out.stdout + out.stderr


HEADLINE = {"eval_loss", "train_loss", "tps", "srv_tps", "ttft_p99", "srv_compile"} | {
    f"gate_{stage}" for stage in ("serve", "numerics", "probes")
}


def figures(c, run) -> dict[tuple[str, str], float]:
    """The run's table of every detailed figure: (stage, figure) -> value."""
    mlflow.set_tracking_uri(c.tracking_uri)  # load_table finds the run through the default store
    table = c.load_table(run.info.experiment_id, "figures.json", run_ids=[run.info.run_id])
    return {(s, f): v for s, f, v in zip(table.stage, table.figure, table.value)}


def epoch(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def client(repo):
    return MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")


STAGES = ["corpus", "tokenize", "warmup", "train", "export", "serve-check", "numerics", "probes", "track"]


def test_repro_runs_every_stage_in_dependency_order(repo, first_run):
    lines = [line for line in first_run.splitlines() if line.startswith("Running stage '")]
    order = [line.split("'")[1] for line in lines]
    assert sorted(order) == sorted(STAGES)
    for before, after in [
        ("tokenize", "warmup"),
        ("tokenize", "train"),
        ("train", "export"),
        ("export", "serve-check"),
        ("warmup", "serve-check"),
        ("export", "numerics"),
        ("export", "probes"),
        ("serve-check", "track"),
        ("numerics", "track"),
        ("probes", "track"),
    ]:
        assert order.index(before) < order.index(after), (before, after, order)
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    assert set(lock["stages"]) == set(STAGES)
    # each stage recorded only the params it reads
    assert set(lock["stages"]["tokenize"]["params"]["params.yaml"]) == {"seed", "data", "tokenizer"}
    assert set(lock["stages"]["train"]["params"]["params.yaml"]) == {"seed", "model", "train", "adamw", "muon"}
    train = json.loads((repo / "metrics/train.json").read_text())
    assert train["steps"] == TINY_PARAMS["train.steps"] and train["val_loss"] < train["val_loss_initial"]
    warmup = json.loads((repo / "metrics/warmup.json").read_text())
    assert warmup["graphs"] == 2 + 1  # decode widths 1, 2 and the prefill bucket 64
    assert warmup["warm_speedup"] >= 3, warmup  # starting from the cache artifact is several times faster
    serve = json.loads((repo / "metrics/serve-check.json").read_text())
    assert serve["passed"] and serve["padded"]["compile_events"] == 0 and serve["exact"]["compile_events"] > 0
    live = serve["live"]  # laplace serve, started from the warmup cache, served the headline workload
    assert live["served"] == live["requests"] == 12 and live["compile_events"] == 0
    assert live["server_exit_status"] == 0 and serve["live_vs_replay"]["output_tokens_per_s"] > 0
    status = run(DVC + ["status"], repo).stdout
    assert "Data and pipelines are up to date" in status
    assert "=== Laplace pipeline ===" in first_run and "registered laplace-gla v1 as champion" in first_run
    assert "export PREFECT_API_URL=http://127.0.0.1:4200/api" in first_run
    # each stage command ends with one line of outcome, not its metrics JSON
    assert '"val_loss"' not in first_run and "laplace train: 6 steps, val loss" in first_run
    headline = json.loads((repo / "metrics.json").read_text())
    assert headline["eval_loss"] == round(train["val_loss"], 4) and headline["gates"] == "passed"


def test_mlflow_run_holds_params_metrics_dataset_and_a_registered_pyfunc(repo, first_run):
    c = client(repo)
    exp = c.get_experiment_by_name("laplace")
    assert exp.artifact_location == (repo / "mlartifacts").as_uri()  # absolute, inside the project
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"  # the runs table, not GenAI
    assert not (repo / "mlruns").exists()
    runs = c.search_runs([exp.experiment_id])
    assert len(runs) == 1
    r = runs[0]
    assert r.data.params["train.steps"] == "6" and r.data.params["model.d_model"] == "32"
    assert "muon.lr" in r.data.params and "data.source" in r.data.params
    train = json.loads((repo / "metrics/train.json").read_text())
    assert set(r.data.metrics) == HEADLINE  # short names: the runs table's columns
    assert r.data.metrics["eval_loss"] == pytest.approx(train["val_loss"])
    assert r.data.metrics["tps"] == pytest.approx(train["tokens_per_s"])
    history = c.get_metric_history(r.info.run_id, "train_loss")
    assert [m.step for m in history] == list(range(1, 7))
    assert [m.step for m in c.get_metric_history(r.info.run_id, "eval_loss")] == [0, 3, 6]
    # the run lasts as long as the pipeline run: it starts when the first stage started
    corpus = json.loads((repo / "metrics/corpus.json").read_text())["measured"]  # the first stage
    assert abs(r.info.start_time / 1000 - epoch(corpus["started"])) < 2
    assert all(r.data.tags[f"source.{s}"] == "measured in this run" for s in ("corpus", "tokenize", "train", "probes"))
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    data_md5 = next(o["md5"] for o in lock["stages"]["tokenize"]["outs"] if o["path"] == "data/tokenized")
    assert r.data.tags["dvc_data_hash"] == data_md5
    assert r.data.tags["launcher"] == "dvc"
    assert len(r.data.tags["git_commit"]) == 40 and len(r.data.tags["params_hash"]) == 16
    inputs = r.inputs.dataset_inputs
    assert len(inputs) == 1 and inputs[0].dataset.digest == data_md5 and inputs[0].dataset.name == "tokenized"
    artifacts = {a.path for a in c.list_artifacts(r.info.run_id, "plots")}
    assert "plots/train_curve.png" in artifacts
    assert [a.path for a in c.list_artifacts(r.info.run_id, "tokenizer")] == ["tokenizer/tokenizer.json"]

    version = c.get_model_version_by_alias("laplace-gla", "candidate")
    assert version.run_id == r.info.run_id
    detail = figures(c, r)  # every detailed figure: a table artifact, beside metrics/*.json
    assert detail[("serve-check", "padded/compile_events")] == 0
    assert detail[("serve-check", "exact/compile_events")] > 0
    assert detail[("warmup", "compile_seconds_total")] > 0
    assert r.data.metrics["ttft_p99"] == pytest.approx(detail[("serve-check", "padded/ttft_p99_s")])
    assert r.data.tags["gate.serve"] == "passed" and r.data.tags["gate.numerics"] == "passed"
    assert detail[("numerics", "max_abs_logit_diff_fp32")] < 1e-3
    assert r.data.metrics["gate_numerics"] == 1.0
    assert "metrics/serve-check.json" in {a.path for a in c.list_artifacts(r.info.run_id, "metrics")}
    champion = c.get_model_version_by_alias("laplace-gla", "champion")  # gates passed, the first
    assert champion.version == c.get_model_version_by_alias("laplace-gla", "candidate").version
    assert r.data.tags["registered_as"] == "champion"

    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{repo / 'mlflow.db'}")
    model = mlflow.pyfunc.load_model("models:/laplace-gla@candidate")
    prompts = pd.DataFrame({"prompt": ["The function"]})
    short = model.predict(prompts, params={"max_new_tokens": 3, "temperature": 0.0})
    longer = model.predict(prompts, params={"max_new_tokens": 12, "temperature": 0.0})
    assert len(short) == 1 and isinstance(short[0], str)
    assert longer[0].startswith(short[0]) and len(longer[0]) > len(short[0])  # greedy, runtime param honoured


def test_second_repro_is_a_no_op(repo, first_run):
    out = run(DVC + ["repro"], repo)
    assert ran_stages(out.stdout) == set()
    assert len(client(repo).search_runs([client(repo).get_experiment_by_name("laplace").experiment_id])) == 1


def test_params_change_reruns_only_downstream_and_experiments_compare(repo, first_run):
    commit_all(repo, "baseline pipeline run")
    # a lower learning rate, trained by 2 ranks under torchrun (sharded Muon)
    out = run(
        DVC
        + [
            "exp",
            "run",
            "--set-param",
            "train.lr=0.001",
            "--set-param",
            "train.nproc_per_node=2",
            "--name",
            "lower-lr",
        ],
        repo,
    )
    assert ran_stages(out.stdout) == {
        "train",
        "export",
        "serve-check",
        "numerics",
        "probes",
        "track",
    }  # not tokenize/warmup
    shown = json.loads(run(DVC + ["exp", "show", "--json"], repo).stdout)
    assert "lower-lr" in json.dumps(shown)
    diff = json.loads(run(DVC + ["metrics", "diff", "--json"], repo).stdout)
    assert "eval_loss" in diff["metrics.json"] and "metrics/train.json" not in diff  # the headline only
    # the README's comparisons print readably at an 80-column terminal
    narrow = env(COLUMNS="80")
    # (the README changes one param; this experiment two: the launch knob is dropped as well)
    readme_drop = "Created|laplace|.*/.*"
    exp_show = ["exp", "show", "--only-changed", "--drop", readme_drop + "|train.nproc_per_node", "--no-pager"]
    for command in (["metrics", "show"], ["metrics", "diff"], exp_show):
        out = run(DVC + command, repo, env=narrow).stdout
        assert max(map(len, out.splitlines())) <= 80 and "…" not in out, out
        assert "eval_loss" in out
    plots = json.loads(run(DVC + ["plots", "diff", "--json"], repo).stdout)["data"]
    mqar = plots["plots/probes_mqar.json"][0]["content"]
    assert mqar["encoding"]["x"]["field"] == "context" and mqar["encoding"]["color"]["field"] == "series"
    assert len({row["rev"] for row in mqar["data"]["values"]}) == 2  # the baseline commit and the experiment
    c = client(repo)
    runs = c.search_runs([c.get_experiment_by_name("laplace").experiment_id], order_by=["start_time ASC"])
    assert [r.data.params["train.lr"] for r in runs] == ["0.003", "0.001"]
    assert runs[1].data.tags.get("dvc_experiment") == "lower-lr"
    first, second = figures(c, runs[0]), figures(c, runs[1])
    assert second[("train", "world_size")] == 2 and first[("train", "world_size")] == 1
    assert second[("train", "traffic/muon_bytes_per_rank_per_step_max")] > 0
    assert int(c.get_model_version_by_alias("laplace-gla", "candidate").version) == 2
    # champion only when no worse than v1 on the same validation windows (tolerance 0)
    better = runs[1].data.metrics["eval_loss"] <= runs[0].data.metrics["eval_loss"]
    assert int(c.get_model_version_by_alias("laplace-gla", "champion").version) == (2 if better else 1)
    assert runs[1].data.tags["registered_as"] == ("champion" if better else "candidate")
    assert "champion v1's" in runs[1].data.tags["registered_reason"]
    # tokenize and warmup did not run again: their figures say which run measured them
    cached = f"cached from run {runs[0].info.run_name} ({runs[0].info.run_id[:8]}), measured "
    assert runs[1].data.tags["source.tokenize"].startswith(cached)
    assert runs[1].data.tags["source.warmup"].startswith(cached)
    assert runs[1].data.tags["source.train"] == "measured in this run"
    train = json.loads((repo / "metrics/train.json").read_text())["measured"]
    assert abs(runs[1].info.start_time / 1000 - epoch(train["started"])) < 2  # this run began with train
    assert "Data and pipelines are up to date" in run(DVC + ["status"], repo).stdout


def test_a_stage_restored_from_the_run_cache_says_which_run_measured_it(repo, first_run):
    """Back to the first run's params (as a Prefect override may do): train runs again and its
    export is byte-identical, so `dvc repro` restores serve-check, numerics and probes from its
    run-cache. MLflow and the summary say their figures, timings included, are the first run's."""
    out = run([str(BIN / "laplace"), "run", "--set", "train.lr=0.003", "--set", "train.nproc_per_node=1"], repo)
    restored = {line.split("'")[1] for line in out.stdout.splitlines() if "is cached - skipping run" in line}
    assert {"serve-check", "numerics", "probes"} <= restored, out.stdout[-3000:]
    c = client(repo)
    runs = c.search_runs([c.get_experiment_by_name("laplace").experiment_id], order_by=["start_time ASC"])
    first, last = runs[0], runs[-1]
    cached = f"cached from run {first.info.run_name} ({first.info.run_id[:8]}), measured "
    assert all(last.data.tags[f"source.{stage}"].startswith(cached) for stage in ("serve-check", "numerics", "probes"))
    assert last.data.tags["source.train"] == "measured in this run"
    serving = out.stdout[out.stdout.index("\nserving") : out.stdout.index("\nnumerics")]
    assert cached in serving  # the summary says so under the serving figures


def test_plots_render_offline(repo, first_run):
    run(DVC + ["plots", "show"], repo)
    html = (repo / "dvc_plots" / "index.html").read_text()
    import re

    assert not re.search(r"""<(script|link)[^>]+(src|href)=["']?https?://""", html)  # nothing fetched
    assert "cdn.jsdelivr" not in html
    assert "vegaEmbed" in html and "training loss" in html and "train_curve.png" in html


def test_push_and_pull_through_the_default_remote(repo, first_run):
    run(DVC + ["push"], repo)
    shutil.rmtree(repo / "data" / "tokenized")
    shutil.rmtree(repo / ".dvc" / "cache")
    run(DVC + ["pull"], repo)
    assert (repo / "data" / "tokenized" / "manifest.json").exists()
    assert (repo / "dvc-remote").is_dir()
    assert "Data and pipelines are up to date" in run(DVC + ["status"], repo).stdout
