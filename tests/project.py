"""Temporary copies of this project for end-to-end tests: a real git + DVC repo of the working tree."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

# What the suite sets for every process it starts (conftest, before Inductor's config is imported):
# - its C++ compiler, which keeps outputs by content (why: tests/compiler/cxx_cache.py). The store
#   outlives the run, like ccache's; a fresh clone starts empty. LAPLACE_CXX_CACHE= (empty) turns it off.
# - trust of the CPU's flags: Inductor otherwise probes the vector ISAs in every new compile cache,
#   compiling a small library per ISA and loading each in a child Python (about 1 s a process with the
#   kept outputs, 7.8 s without). The suite starts a fresh cache in every stage, server and worker; the
#   ISA Inductor picks is the same here. test_warmup's cold compile keeps the probe; the product always does.
SUITE_COMPILE_ENV = {
    "CXX": str(Path(__file__).parent / "compiler" / "g++"),
    "LAPLACE_CXX_PYTHON": sys.executable,  # runs tests/compiler/cxx_cache.py
    "LAPLACE_CXX_CACHE": str(ROOT / ".pytest_cache" / "cxx-outputs"),
    "TORCHINDUCTOR_VEC_ISA_OK": "1",
}

# pytest-timeout's limit (fixtures included) for a test that may set up a whole pipeline run (a
# `laplace run`, a Prefect deployment run): the fla import's passed 900 s in CI (load 1-8); the rest get 600 s
PIPELINE_TIMEOUT_S = 1800
PIPELINE_RUN_S = 1500  # the subprocess limit of such a run (project.run's default is 900 s)

# The tests' tiny model: the tiny preset cut to one 32-wide layer (the one copy; tests that need
# more layers or another vocabulary say so with overrides).
TINY_MODEL = {"d_model": 32, "n_layers": 1, "n_heads": 2, "chunk_size": 16, "sub_chunk_size": 8}


# A 2-layer model on a 300-document corpus: the training and probe tests' config sections
TWO_LAYER_RUN = {
    "data": {"max_documents": 300, "num_proc": 1},
    "tokenizer": {"vocab_size": 400},
    "model": {"preset": "tiny", "d_model": 64, "n_layers": 2, "n_heads": 2, "chunk_size": 16, "sub_chunk_size": 8},
}


def write_model_export(model, tokenizer: Path, out: Path, step: int = 0, bos_id=None, eos_id=None) -> Path:
    """An export directory of `model` (a LaplaceLM, as it is) with the tokenizer.json at `tokenizer`."""
    from laplace.model.export import FORMAT, write_export
    from laplace.tokenizer_file import load_tokenizer, tokenizer_sha256

    config = {
        "format": FORMAT,
        "model": model.cfg.architecture(),
        "step": step,
        "tokenizer_sha256": tokenizer_sha256(load_tokenizer(tokenizer)),
        "bos_id": bos_id,
        "eos_id": eos_id,
    }
    write_export(model.state_dict(), config, tokenizer, out)
    return out


def tiny_model_config(vocab_size: int, **overrides):
    """The tests' tiny ModelConfig (TINY_MODEL), with field overrides."""
    from laplace.model.config import preset_model_config

    return preset_model_config("tiny", vocab_size=vocab_size, **{**TINY_MODEL, **overrides})


# A pipeline small enough to run end to end in well under a minute on 2 cores.
TINY_PARAMS = {
    "data.max_documents": 200,
    "data.num_proc": 1,
    "tokenizer.vocab_size": 300,
    **{f"model.{key}": value for key, value in TINY_MODEL.items()},
    "train.steps": 6,
    "train.batch_size": 2,
    "train.seq_len": 32,
    "train.eval_every": 3,
    "train.eval_batches": 1,
    "train.checkpoint_every": 3,
    "train.log_every": 1,
    "pipeline.retries": 0,
    "engine.max_slots": 2,  # each compiled graph costs ~6-11 s on 2 cores whatever the model size
    "engine.prefill_buckets": [64],
    "engine.max_prompt_tokens": 64,
    "serve_check.requests": 12,
    "serve_check.workloads": ["batch", "poisson"],
    "serve_check.prompt_tokens": [4, 64],
    "serve_check.shared_prefix_tokens": 32,  # serve-check's shared_prefix workload within max_prompt_tokens
    "serve_check.output_tokens": [2, 12],
    "serve_check.decode_contexts": [256, 1024],
    "serve_check.decode_timing_steps": 16,
    # a 1-layer model's ~1 ms steps are noisy (1.5 was missed at load 4: the fla import's run of
    # 2026-12-02); the gate logic is unit-tested, and a K/V cache's cost grows 4x over 256 -> 1,024
    "serve_check.max_decode_cost_ratio": 3.0,
    # fp32 only: bf16's three graphs are ~75 s of cold compiles per run (six runs in the suite); bf16
    # is checked by run_numerics, the stage worker's function, on a hybrid export (tests/test_probes.py)
    "numerics.precisions": ["fp32"],
    # no training-step check: its forward and backward graphs are ~45 CPU-s of cold compile per run (three
    # runs); run_numerics checks them on the hybrid export (test_probes) and the Gated DeltaNet one
    # (test_numerics), broken and healthy
    "numerics.train_step": False,
    "numerics.batch_size": 2,
    "numerics.seq_len": 32,
    "numerics.prompt_tokens": 16,
    "numerics.greedy_prompts": 2,
    "numerics.greedy_tokens": 8,
    "probes.mqar_contexts": [32, 64],
    "probes.mqar_pairs": [2, 4],
    "probes.mqar_samples": 4,
    "probes.passkey_contexts": [128, 256],  # the needle and question alone take ~80 tokens at vocab 300
    "probes.passkey_depths": [0.5],
    "probes.passkey_samples": 1,
    "probes.recall_contexts": [512],  # 4 needles and the question take ~250 tokens at vocab 300
    "probes.recall_samples": 1,
    "probes.memory_contexts": [128, 512],
    "probes.mqar_train_steps": 10,
    "probes.mqar_train_d_model": 32,
    "probes.mqar_train_seq_len": 32,
    "probes.mqar_train_pairs": 4,
}


def env(**extra: str) -> dict[str, str]:
    e = dict(os.environ)
    e["PATH"] = f"{BIN}{os.pathsep}{e.get('PATH', '')}"
    e["DVC_NO_ANALYTICS"] = "1"
    e.pop("MLFLOW_TRACKING_URI", None)
    e.update(extra)
    return e


def direct_flow_env(tmp_path: Path) -> dict[str, str]:
    """A flow run with no server (`python flows/X.py`): Prefect starts a temporary one, given 300 s
    to answer (its default 20 s is too few on 2 loaded cores)."""
    e = env(
        PREFECT_HOME=str(tmp_path / "prefect-home"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="300",
    )
    e.pop("PREFECT_API_URL", None)
    return e


def run(cmd: list[str], cwd: Path, check: bool = True, timeout: float = 900, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=kw.pop("env", env()), **kw)
    if check and out.returncode != 0:
        raise AssertionError(
            f"{' '.join(map(str, cmd))} exited {out.returncode}\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
        )
    return out


def copy_project(dest: Path, params: dict | None = None) -> Path:
    """Copy the working tree (tracked + untracked, not ignored) into `dest`, set params, commit."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_symlink():  # compare/laplace-src, compare/.dvc/plots: links, as git keeps them
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            (dest / rel).symlink_to(src.readlink())
        elif src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    for generated in ("dvc.lock", "metrics", "plots", "compare/dvc.lock"):  # a fresh start, whatever the checkout holds
        p = dest / generated
        shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
    if params:
        set_params(dest / "params.yaml", params)
    run(["git", "init", "-q", "-b", "main"], dest)
    run(["git", "add", "-A"], dest)
    run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "copy"], dest)
    return dest


def set_params(path: Path, values: dict) -> None:
    """Validated and written like `dvc exp run --set-param` (comments kept)."""
    from laplace.pipeline.params import write_params

    write_params(path, values)


def run_bench(script: str, *args: str, exit_status: int = 0, timeout: float = 600) -> dict:
    """`python bench/<script> args` from the checkout, one OpenMP thread, as bench/RESULTS.md runs
    it: the JSON object of its last line, once it exited with `exit_status`."""
    out = subprocess.run(
        [sys.executable, f"bench/{script}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env(OMP_NUM_THREADS="1"),
    )
    assert out.returncode == exit_status, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def commit_all(repo: Path, message: str) -> None:
    run(["git", "add", "-A"], repo)
    run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", message], repo)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def wait_until_answers(proc: subprocess.Popen, url: str, timeout_s: float) -> None:
    """Poll GET `url` until it answers 200; fails with the server's output if it exits first."""
    import time

    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            tail = proc.stdout.read()[-3000:] if proc.stdout else ""
            raise AssertionError(f"{proc.args[:4]} exited with {proc.returncode} before {url} answered:\n{tail}")
        assert time.monotonic() < deadline, f"{url} did not answer 200 within {timeout_s:.0f}s"
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


# What the stages before track leave on disk: the spool `laplace track` logs from.
SPOOL_TRAIN = {"steps": 6, "val_loss": 4.25, "val_loss_initial": 5.75, "val_ppl": 70.1, "tokens_per_s": 1234.5}


def write_stage_results(root: Path) -> None:
    """What the stages before track leave on disk (the spool track logs from), plus params.yaml."""
    shutil.copy2(ROOT / "params.yaml", root / "params.yaml")
    results = {
        "metrics/tokenize.json": {"documents_read": 200, "tokens_train": 41000, "tokens_val": 2100},
        "metrics/train.json": SPOOL_TRAIN,
        "metrics/serve-check.json": {"passed": True, "padded": {"compile_events": 0}},
        "metrics/numerics.json": {"passed": True, "max_abs_logit_diff_fp32": 2e-6},
        "plots/train_loss.json": [{"step": s, "loss": 6.0 - s / 4, "tokens_per_s": 1000.0 + s} for s in range(1, 7)],
        "plots/val_loss.json": [{"step": 3, "val_loss": 4.9}, {"step": 6, "val_loss": 4.25}],
    }
    for rel, data in results.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(json.dumps(data))
