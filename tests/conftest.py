import os
import shutil
from pathlib import Path

import suite_timing
from project import SUITE_COMPILE_ENV, TINY_MODEL  # both stdlib only, so imported before torch

# set before Inductor's config is imported, and inherited by every process the tests start
for _name, _value in SUITE_COMPILE_ENV.items():
    os.environ.setdefault(_name, _value)

import pytest  # noqa: E402
import torch  # noqa: E402

# Tests run on 2 cores, in PYTEST_XDIST_WORKER_COUNT worker processes under `make test` (-n 2): each
# worker gets its share of the cores, and so do the processes it starts (pipeline stages, servers,
# torchrun ranks: OMP_NUM_THREADS), so 2 workers never run 4 OpenMP threads on 2 cores. A thread
# whose sibling is descheduled makes a whole step wait (docs/testing.md).
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = max(1, min(2, (os.cpu_count() or 1) // WORKERS))
for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_name, str(THREADS))
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# fp32 tests compare at 1e-5: TF32 (cuDNN's default for convolutions on CUDA) would give ~1e-3.
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
# ... and Triton's fp32 dots (flash-linear-attention's kernels) likewise; read when a kernel compiles.
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

# Numerical tests that take `device` run on the CPU everywhere and on CUDA where a GPU is present.
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
]


def rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative RMS error ||a - e|| / ||e||, computed in fp64."""
    a, e = actual.double(), expected.double()
    return ((a - e).pow(2).mean().sqrt() / e.pow(2).mean().sqrt().clamp(min=1e-30)).item()


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)


@pytest.fixture(scope="module", autouse=True)
def fresh_compiler_caches():
    """Each module starts with Dynamo's caches empty: an xdist worker runs many modules in one
    process, and recompiles of the same code object (a GLA block's forward) count toward
    torch._dynamo.config.recompile_limit across all of them, so a module's compiled run could hit
    the limit only because of what ran before it on that worker (test_train, CI of 2026-12-02)."""
    torch._dynamo.reset()
    yield


@pytest.fixture
def seeded():
    torch.manual_seed(0)
    yield


def shared_by_workers(tmp_path_factory, name: str, build):
    """`build(dir)` once for the whole run: under xdist the first worker to ask builds it in the
    run's common temporary directory, the others wait on a file lock and reuse it (pytest-xdist's
    recipe); without xdist it is a plain temporary directory. Returns the directory."""
    from filelock import FileLock

    if WORKERS == 1 or "PYTEST_XDIST_WORKER" not in os.environ:
        out = tmp_path_factory.mktemp(name)
        build(out)
        return out
    common = tmp_path_factory.getbasetemp().parent
    out, done = common / name, common / f"{name}.done"
    with FileLock(str(common / f"{name}.lock")):
        if not done.exists():
            out.mkdir(exist_ok=True)
            build(out)
            done.touch()
    return out


@pytest.fixture(scope="session")
def tiny_artifacts(tmp_path_factory):
    """A tokenized corpus and an exported, briefly trained 1-layer model: (data_dir, export_dir).
    Built once per run, shared by the xdist workers (read it, do not change it)."""
    root = shared_by_workers(tmp_path_factory, "tiny-artifacts", build_tiny_artifacts)
    return root / "tokenized", root / "export"


def build_tiny_artifacts(root):
    from laplace.config import config_from_dict
    from laplace.data.tokenize import tokenize_corpus
    from laplace.model.export import export_model
    from laplace.training import checkpoint as ckpt
    from laplace.training.loop import train

    cfg = config_from_dict(
        {
            "data": {"max_documents": 300, "num_proc": 1},
            "tokenizer": {"vocab_size": 400},
            "model": {"preset": "tiny", **TINY_MODEL},
            "train": {
                "steps": 20,
                "batch_size": 4,
                "seq_len": 32,
                "eval_every": 20,
                "eval_batches": 1,
                "checkpoint_every": 20,
                "warmup_steps": 2,
            },
        }
    )
    data_dir, export_dir = root / "tokenized", root / "export"
    tokenize_corpus(cfg.data, cfg.tokenizer, data_dir, cfg.seed)
    result = train(cfg, data_dir, root / "run", progress=False)
    export_model(ckpt.load_checkpoint(result.checkpoint), data_dir / "tokenizer.json", export_dir)


@pytest.fixture(scope="session")
def tiny_pipeline(tmp_path_factory):
    """The main job once per session: `laplace run` (dvc repro + the summary) on the tests' tiny
    params in a real git + DVC repo: (repo, its output). End-to-end tests that read a finished
    pipeline's outputs use this one run; their modules are TINY_PIPELINE_MODULES, one xdist work
    unit (a session fixture is per worker under xdist: the unit keeps its users on one).
    tests/test_pipeline_dvc.py changes the repo after its reading tests (an experiment, a second
    run, push/pull): a test that needs another state copies it (`cp -a` of the repo takes seconds; docs/testing.md)."""
    from project import BIN, PIPELINE_RUN_S, TINY_PARAMS, copy_project, run

    repo = copy_project(tmp_path_factory.mktemp("tiny-pipeline"), TINY_PARAMS)
    out = run([str(BIN / "laplace"), "run"], repo, timeout=PIPELINE_RUN_S)
    # the finished run as it stood, before any test changes it: the DVC side only (the MLflow store
    # names this repo's absolute path), for tests that start from a finished pipeline (tiny_pipeline_copy)
    shutil.copytree(repo, repo.parent / PRISTINE, symlinks=True, ignore=shutil.ignore_patterns(*MLFLOW_STORE))
    return repo, out.stdout + out.stderr


PRISTINE = "tiny-pipeline-pristine"
MLFLOW_STORE = ("mlflow.db", "mlartifacts", "mlruns", ".prefect")


@pytest.fixture
def tiny_pipeline_copy(tiny_pipeline, tmp_path):
    """A copy of the session's finished tiny pipeline (git, DVC cache, outputs, dvc.lock; no MLflow
    store): a test that reruns some stages of it pays for those stages, not for a whole run."""
    repo = tiny_pipeline[0]
    return Path(shutil.copytree(repo.parent / PRISTINE, tmp_path / "laplace", symlinks=True))


# --------------------------------------------------------------------------- xdist work units, order

SHARED_RUN_GROUP = "tiny_pipeline"
# The modules whose tests use the tiny_pipeline fixture: they share one worker, so one pipeline run.
TINY_PIPELINE_MODULES = {"tests/test_pipeline_dvc.py", "tests/test_pipeline_prefect.py"}


def group_of(nodeid: str) -> str:
    """The xdist work unit of a test: its module, or the tiny_pipeline group."""
    module = nodeid.split("::", 1)[0]
    return SHARED_RUN_GROUP if module in TINY_PIPELINE_MODULES else module


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # before xdist's own (it picks one by --dist)
def pytest_xdist_make_scheduler(config, log):
    """Each work unit (group_of) runs whole on one worker, so its module fixtures (servers, tokenized
    projects, pipeline runs) are built once. xdist's loadgroup does this through "@group" node ids,
    which pytest 9 no longer lets a plugin set; loadscope splits by module, so it is the base."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return ModuleGroups(config, log)


def pytest_collection_modifyitems(config, items):
    """Work units run heaviest first by tests/durations.json (without it: most slow-marked tests
    first), so the longest does not start last
    (the run's tail is one unit long); within a unit, the file's order. A test of tiny_pipeline
    outside TINY_PIPELINE_MODULES would run the pipeline again on the other worker: refused."""
    strays = sorted(
        {i.nodeid.split("::")[0] for i in items if "tiny_pipeline" in i.fixturenames} - TINY_PIPELINE_MODULES
    )
    if strays:
        raise pytest.UsageError(f"{', '.join(strays)} use tiny_pipeline: add them to TINY_PIPELINE_MODULES (conftest)")
    weights, units = suite_timing.recorded_walls(), suite_timing.recorded_units()
    groups: dict[str, list] = {}
    for item in items:
        groups.setdefault(group_of(item.nodeid), []).append(item)

    def weight(group: list) -> tuple[float, int]:  # the unit's recorded seconds; without a record, slow tests
        recorded = units.get(group_of(group[0].nodeid))
        if recorded is None:  # a new unit, or a record without units: its tests among the slowest
            recorded = sum(weights.get(i.nodeid, 0.0) for i in group)
        return recorded, sum(bool(i.get_closest_marker("slow")) for i in group)

    ranked = sorted(groups.values(), key=weight, reverse=True)
    items[:] = [item for group in ranked for item in group]


# --------------------------------------------------------------------------- timing (tests/durations.json)


def pytest_addoption(parser):
    parser.addoption(
        "--record-durations",
        action="store_true",
        help="rewrite tests/durations.json from this run (a full `make test`)",
    )


# in the controller (or the one process without xdist): every test's wall and CPU seconds
TIMINGS = suite_timing.Timings()
CPU_MARK = pytest.StashKey[float]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    item.stash[CPU_MARK] = suite_timing.cpu_seconds()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Each phase's report carries the CPU seconds it took (xdist sends user_properties along)."""
    report = (yield).get_result()
    now = suite_timing.cpu_seconds()
    report.user_properties.append(("cpu_s", now - item.stash.get(CPU_MARK, now)))
    item.stash[CPU_MARK] = now


def pytest_runtest_logreport(report):
    TIMINGS.add(report)  # in a worker too, where nothing reads it


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if hasattr(config, "workerinput") or not TIMINGS.tests:  # an xdist worker (the controller reports); no test ran
        return
    if config.getoption("--record-durations"):
        suite_timing.record(TIMINGS, workers_of(config), group_of)
        terminalreporter.write_line(f"wrote {suite_timing.RECORD}")
    suite_timing.summary(TIMINGS, terminalreporter.write_line)


def workers_of(config) -> int:
    return int(getattr(config.option, "numprocesses", None) or 1)
