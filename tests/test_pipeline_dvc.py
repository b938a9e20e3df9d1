"""End to end through DVC in a temporary clone: repro, no-op repro, a params change, experiments,
metrics, offline plots, push/pull, and the MLflow run with its registered pyfunc model."""

import json
import shutil

import pytest
import yaml
from mlflow import MlflowClient

from project import TINY_PARAMS, commit_all, copy_project, run

pytestmark = pytest.mark.slow

DVC = ["python", "-m", "dvc"]


def ran_stages(output: str) -> set[str]:
    return {line.split("'")[1] for line in output.splitlines() if line.startswith("Running stage '")}


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return copy_project(tmp_path_factory.mktemp("laplace"), TINY_PARAMS)


@pytest.fixture(scope="module")
def first_run(repo):
    out = run(DVC + ["repro"], repo)
    return out.stdout + out.stderr


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
    serve = json.loads((repo / "metrics/serve.json").read_text())
    assert serve["passed"] and serve["padded"]["compile_events"] == 0 and serve["exact"]["compile_events"] > 0
    live = serve["live"]  # laplace serve, started from the warmup cache, served the headline workload
    assert live["served"] == live["requests"] == 12 and live["compile_events"] == 0
    assert live["server_exit_status"] == 0 and serve["live_vs_replay"]["output_tokens_per_s"] > 0
    status = run(DVC + ["status"], repo).stdout
    assert "Data and pipelines are up to date" in status


def test_mlflow_run_holds_params_metrics_dataset_and_a_registered_pyfunc(repo, first_run):
    c = client(repo)
    exp = c.get_experiment_by_name("laplace")
    assert exp.artifact_location == (repo / "mlartifacts").as_uri()  # absolute, inside the project
    assert not (repo / "mlruns").exists()
    runs = c.search_runs([exp.experiment_id])
    assert len(runs) == 1
    r = runs[0]
    assert r.data.params["train.steps"] == "6" and r.data.params["model.d_model"] == "32"
    assert "muon.lr" in r.data.params and "data.source" in r.data.params
    train = json.loads((repo / "metrics/train.json").read_text())
    assert r.data.metrics["train/val_loss"] == pytest.approx(train["val_loss"])
    assert "tokenize/tokens_train" in r.data.metrics and "train/tokens_per_s" in r.data.metrics
    history = c.get_metric_history(r.info.run_id, "train/loss")
    assert [m.step for m in history] == list(range(1, 7))
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
    assert r.data.metrics["serve/padded/compile_events"] == 0
    assert r.data.metrics["serve/exact/compile_events"] > 0
    assert r.data.metrics["warmup/compile_seconds_total"] > 0
    assert "serve/padded/ttft_p99_s" in r.data.metrics
    assert r.data.tags["gate.serve"] == "passed" and r.data.tags["gate.numerics"] == "passed"
    assert r.data.metrics["numerics/max_abs_logit_diff_fp32"] < 1e-3
    assert r.data.metrics["numerics/passed"] == 1.0
    champion = c.get_model_version_by_alias("laplace-gla", "champion")  # both validation stages passed
    assert champion.version == c.get_model_version_by_alias("laplace-gla", "candidate").version

    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{repo / 'mlflow.db'}")
    model = mlflow.pyfunc.load_model("models:/laplace-gla@candidate")
    short = model.predict({"prompt": ["The function"]}, params={"max_new_tokens": 3, "temperature": 0.0})
    longer = model.predict({"prompt": ["The function"]}, params={"max_new_tokens": 12, "temperature": 0.0})
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
    assert "val_loss" in diff["metrics/train.json"]
    shown_metrics = run(DVC + ["metrics", "show"], repo).stdout
    assert "metrics/train.json" in shown_metrics
    c = client(repo)
    runs = c.search_runs([c.get_experiment_by_name("laplace").experiment_id], order_by=["start_time ASC"])
    assert [r.data.params["train.lr"] for r in runs] == ["0.003", "0.001"]
    assert runs[1].data.tags.get("dvc_experiment") == "lower-lr"
    assert runs[1].data.metrics["train/world_size"] == 2 and runs[0].data.metrics["train/world_size"] == 1
    assert runs[1].data.metrics["train/traffic/muon_bytes_per_rank_per_step_max"] > 0
    assert int(c.get_model_version_by_alias("laplace-gla", "candidate").version) == 2
    assert "Data and pipelines are up to date" in run(DVC + ["status"], repo).stdout


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
