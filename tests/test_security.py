"""Security: secrets never reach MLflow or the metrics files, nothing untrusted is unpickled,
servers bind to 127.0.0.1, and params paths cannot climb out of the project.

The tracked run is real: the track stage logs a trained and exported tiny model (the session's
`tiny_artifacts`) into a sqlite MLflow store, with fake secrets in the environment and in params."""

import ast
import re
import shutil
import zipfile
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from laplace.data.readers import iter_documents
from laplace.errors import ConfigError
from laplace.pipeline.cli import main
from laplace.pipeline.layout import Paths
from laplace.pipeline.params import load_config, write_params
from laplace.pipeline.stages import STAGES
from laplace.tracking.redact import redact, secret_values

from project import ROOT, write_stage_results

SECRETS = {
    "HF_TOKEN": "hf_FAKEsecretTOKEN0123456789abcdef",
    "AWS_SECRET_ACCESS_KEY": "FAKEawsSECRETkey/0123456789+abcdefABCDEF",
    "MLFLOW_TRACKING_PASSWORD": "FAKEmlflowPASSWORD-0987654321",
    "MY_API_KEY": "FAKEcustomAPIkey-5555-abcdef",
}
URL_PASSWORD = "p4ss-NOT-in-the-env-42"  # a password inside a URL-valued param
PACKAGE_DIRS = [ROOT / "laplace", ROOT / "flows"]


# --------------------------------------------------------------------------- secrets


@pytest.fixture(scope="module")
def tracked(tiny_artifacts, tmp_path_factory):
    """A project whose track stage ran with secrets in the environment and in two params."""
    data_dir, export_dir = tiny_artifacts
    project = tmp_path_factory.mktemp("tracked")
    write_stage_results(project)
    shutil.copytree(data_dir, project / "data" / "tokenized")
    shutil.copytree(export_dir, project / "artifacts" / "export")
    with pytest.MonkeyPatch.context() as mp:
        for name, value in SECRETS.items():
            mp.setenv(name, value)
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)  # the project's own sqlite store
        mp.chdir(project)
        cfg = load_config(
            project / "params.yaml",
            {
                "data.hub_path": f"my-org/{SECRETS['HF_TOKEN']}",  # a token pasted into a param by mistake
                "data.hub_name": f"https://reader:{URL_PASSWORD}@corpus.example.com/dump",
                "tracking.retry_seconds": 0,
            },
        )
        summary = STAGES["track"].run(cfg, Paths.at(project))
    return project, summary


def files_under(*paths: Path) -> list[Path]:
    return [p for path in paths for p in ([path] if path.is_file() else sorted(path.rglob("*"))) if p.is_file()]


@pytest.mark.slow
def test_no_secret_in_any_param_tag_artifact_or_metrics_file(tracked):
    project, summary = tracked
    run = MlflowClient(f"sqlite:///{project / 'mlflow.db'}").get_run(summary["run_id"])
    secrets = [*SECRETS.values(), URL_PASSWORD]
    logged = list(run.data.params.values()) + list(run.data.tags.values()) + [run.info.run_name]
    assert not [(s, v) for s in secrets for v in logged if s in v]
    scanned = files_under(
        project / "mlflow.db",
        project / "mlartifacts",
        project / "metrics",
        project / "plots",
        project / "artifacts" / "tracking.json",
    )
    # every byte MLflow stored (the database holds params, tags, inputs; the artifact tree the
    # plots, tokenizer and model) and every results file
    assert any(p.name == "MLmodel" for p in scanned) and len(scanned) > 20
    leaks = [
        (str(p.relative_to(project)), name)
        for p in scanned
        for name, s in [*SECRETS.items(), ("url password", URL_PASSWORD)]
        if s.encode() in p.read_bytes()
    ]
    assert leaks == []


@pytest.mark.slow
def test_a_secret_pasted_into_a_param_is_redacted_in_mlflow(tracked):
    project, summary = tracked
    params = MlflowClient(f"sqlite:///{project / 'mlflow.db'}").get_run(summary["run_id"]).data.params
    assert params["data.hub_path"] == "my-org/***"
    assert params["data.hub_name"] == "https://reader:***@corpus.example.com/dump"
    assert params["train.steps"] == "300" and params["tracking.retry_seconds"] == "0.0"  # the rest untouched


def test_redact_masks_secret_env_values_and_url_passwords_only():
    env = {
        "HF_TOKEN": "hf_abcdefgh12345678",
        "DB_PASSWORD": "correct-horse",
        "MY_API_KEY": "k-1234567890",
        "TOKENIZERS_PARALLELISM": "false",
        "AWS_ACCESS_KEY_ID": "short",
        "HOME": "/home/someone-long",
    }
    found = secret_values(env)
    assert set(found) == {"hf_abcdefgh12345678", "correct-horse", "k-1234567890"}  # flags and short values kept
    text = "hub hf_abcdefgh12345678, db correct-horse, false, /home/someone-long, https://u:pw-9@h.example/x"
    assert redact(text, found) == "hub ***, db ***, false, /home/someone-long, https://u:***@h.example/x"
    assert redact("http://127.0.0.1:5000/api", []) == "http://127.0.0.1:5000/api"


# --------------------------------------------------------------------------- pickle

UNPICKLING_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "joblib", "shelve", "marshal"}


def unpickling_uses(source: str, filename: str = "<string>") -> list[str]:
    """Code (not comments or docstrings) that may unpickle: the pickle family of modules, torch.load
    without weights_only=True, numpy's allow_pickle=True, pandas' read_pickle."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            found += [f"{where} import {a.name}" for a in node.names if a.name.split(".")[0] in UNPICKLING_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in UNPICKLING_MODULES:
                found.append(f"{where} from {node.module} import")
            if node.module.split(".")[0] == "torch" and any(a.name == "load" for a in node.names):
                found.append(f"{where} from {node.module} import load")
        elif isinstance(node, ast.Attribute) and node.attr in ("read_pickle", "Unpickler"):
            found.append(f"{where} .{node.attr}")
        elif isinstance(node, ast.Call):
            func = node.func
            kw = {k.arg: k.value for k in node.keywords}
            is_torch_load = (
                isinstance(func, ast.Attribute)
                and func.attr == "load"
                and ast.unparse(func.value) in ("torch", "torch.serialization")
            )
            if is_torch_load and not (
                isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True
            ):
                found.append(f"{where} {ast.unparse(func)}( without weights_only=True")
            if isinstance(kw.get("allow_pickle"), ast.Constant) and kw["allow_pickle"].value is True:
                found.append(f"{where} allow_pickle=True")
    return found


def test_the_pickle_check_catches_what_it_should():
    planted = (
        "import pickle\nfrom cloudpickle import loads\nimport torch\nx = torch.load('m.pt')\n"
        "y = torch.load('m.pt', weights_only=False)\nz = torch.load('m.pt', weights_only=True)\n"
        "import numpy as np\nw = np.load('a.npy', allow_pickle=True)\n'''pickle in a docstring'''\n"
    )
    found = unpickling_uses(planted)
    assert len(found) == 5 and not any(":6 " in f for f in found), found  # weights_only=True passes


def test_package_source_never_unpickles():
    files = [p for d in PACKAGE_DIRS for p in sorted(d.rglob("*.py"))]
    assert len(files) > 20
    found = [f for p in files for f in unpickling_uses(p.read_text(), str(p.relative_to(ROOT)))]
    assert found == []


@pytest.mark.slow
def test_logged_pyfunc_model_holds_no_pickle(tracked):
    project, _ = tracked
    mlmodels = list((project / "mlartifacts").rglob("MLmodel"))
    assert len(mlmodels) == 1
    model_dir = mlmodels[0].parent
    flavor = yaml.safe_load(mlmodels[0].read_text())["flavors"]["python_function"]
    assert "python_model" not in flavor and flavor["model_code_path"].endswith("mlflow_model.py")  # from code
    files = files_under(model_dir)
    assert any(p.suffix == ".safetensors" for p in files)  # the weights are there, as safetensors
    pickles = [p for p in files if re.search(r"\.(pkl|pickle|pt|pth|joblib)(\.|$)", p.name)]
    pickles += [
        p
        for p in files
        if zipfile.is_zipfile(p) and any(n.endswith((".pkl", ".pickle")) for n in zipfile.ZipFile(p).namelist())
    ]  # torch.save archives
    assert pickles == []


# --------------------------------------------------------------------------- servers bind to 127.0.0.1

SERVER_COMMAND = re.compile(r"mlflow\s+(ui|server)\b|prefect\s+server\s+start|uvicorn\b|gunicorn\b|--with-healthcheck")
SERVER_WORDS = {"mlflow", "prefect", "uvicorn", "gunicorn"}


def server_commands_off_loopback(source: str) -> list[str]:
    """Server commands that Python code builds (a command string, f-string or argv list) and that
    do not bind to 127.0.0.1."""
    bad, tree = [], ast.parse(source)
    in_fstrings = {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for part in node.values}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Constant, ast.JoinedStr)) and id(node) not in in_fstrings:
            parts = [node] if isinstance(node, ast.Constant) else node.values
            text = "".join(p.value if isinstance(p, ast.Constant) and isinstance(p.value, str) else "{}" for p in parts)
            if re.search(f"(?:{SERVER_COMMAND.pattern})\\s+-", text) and "--host 127.0.0.1" not in text:
                bad.append(text.strip())
        elif isinstance(node, (ast.List, ast.Tuple)):
            words = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            names = {Path(w).name for w in words}
            if names & SERVER_WORDS and names & {"server", "ui"}:
                host = words[words.index("--host") + 1] if "--host" in words[:-1] else None
                if host != "127.0.0.1":
                    bad.append(" ".join(words))
    return bad


def test_servers_we_start_bind_to_loopback():
    makefile = (ROOT / "Makefile").read_text().splitlines()
    commands = [line for line in makefile if line.startswith("\t") and SERVER_COMMAND.search(line)]
    assert len(commands) >= 2  # prefect-server, mlflow-ui
    assert [c for c in commands if "--host 127.0.0.1" not in c] == []
    for path in [ROOT / "Makefile", ROOT / "prefect.yaml", ROOT / "dvc.yaml"]:
        assert "0.0.0.0" not in path.read_text(), path
    planted = (
        'cmd = ["mlflow", "server", "--host", "0.0.0.0"]\nui = f"mlflow ui --port {port}"\n'
        'ok = ["prefect", "server", "start", "--host", "127.0.0.1"]\nhint = "open with `mlflow ui` (README)"\n'
    )
    assert len(server_commands_off_loopback(planted)) == 2  # the check catches what it should
    for path in [p for d in PACKAGE_DIRS for p in sorted(d.rglob("*.py"))]:
        text = path.read_text()
        assert "0.0.0.0" not in text and server_commands_off_loopback(text) == [], path


# --------------------------------------------------------------------------- paths stay in the project


@pytest.mark.parametrize(
    "override,key,value",
    [
        ({"data.path": "../x.txt"}, "data.path", "../x.txt"),
        ({"data.path": "corpus/../../../etc"}, "data.path", "corpus/../../../etc"),
        ({"tokenizer.from": "../../etc/passwd"}, "tokenizer.from", "../../etc/passwd"),
        ({"data.hub_path": "../private-corpus"}, "data.hub_path", "../private-corpus"),
    ],
)
def test_relative_path_escaping_the_project_is_a_one_line_config_error(override, key, value):
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "params.yaml", override)
    message = str(err.value)
    assert message.startswith(f"{key}: {value!r} resolves outside the project (")
    assert message.endswith("; give an absolute path to read outside it") and "\n" not in message


def test_escape_is_rejected_before_anything_runs_or_is_written(tmp_path, monkeypatch, capsys):
    params = tmp_path / "params.yaml"
    shutil.copy2(ROOT / "params.yaml", params)
    monkeypatch.chdir(tmp_path)
    assert (
        main(
            [
                "tokenize",
                "--params",
                str(params),
                "--set",
                "data.source=files",
                "--set",
                "data.path=../../etc/passwd",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("laplace tokenize: error: data.path: '../../etc/passwd' resolves outside the project")
    assert not (tmp_path / "data").exists() and not (tmp_path / "metrics").exists()
    before = params.read_text()
    with pytest.raises(ConfigError, match=r"^tokenizer.from: '\.\./t.json' resolves outside"):
        write_params(params, {"tokenizer.from": "../t.json"})  # laplace run --set / the Prefect flow
    assert params.read_text() == before


def test_absolute_paths_outside_and_relative_paths_inside_are_read(tmp_path, monkeypatch):
    outside, project = tmp_path / "outside", tmp_path / "project"
    (project / "corpus").mkdir(parents=True)
    outside.mkdir()
    far = "An absolute path reads a document outside the project, explicitly and on purpose. " * 2
    near = "A relative path inside the project reads a document from the corpus folder there. " * 2
    (outside / "far.txt").write_text(far)
    (project / "corpus" / "near.txt").write_text(near)
    monkeypatch.chdir(project)
    cfg = load_config(
        ROOT / "params.yaml",
        {
            "data.source": "files",
            "data.max_documents": 0,
            "data.path": str(outside / "far.txt"),
            "tokenizer.from": str(outside / "tokenizer.json"),
        },
    )
    assert cfg.data.path == str(outside / "far.txt") and cfg.tokenizer.from_ == str(outside / "tokenizer.json")
    assert list(iter_documents(cfg.data)) == [far]
    inside = load_config(ROOT / "params.yaml", {"data.source": "files", "data.path": "./corpus/../corpus"})
    assert list(iter_documents(inside.data)) == [near]
