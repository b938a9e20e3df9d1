"""Stage workers: a stage runs its measurement in a fresh `python -m laplace.pipeline.<stage>` process.

A fresh process is what a deployment pays (its own compile cache, no warm state left
over from the parent). Both sides of that contract live here:
- the parent: `run_worker` writes the effective config, runs the module, streams its
  output and returns the JSON result it wrote; `compile_env` points the worker's compile
  cache at a directory;
- the child: `worker_main` parses the common arguments, runs the module's body and writes
  its result atomically.

Exit statuses carry the verdict across the process boundary: a worker that rejects its
input (an InputError: bad params or data, a missed gate) exits 2 and the parent raises an
InputError with the worker's one line; any other failure (a crash, a kill) is a
WorkerFailed, which the front doors treat as transient (Prefect retries it). Under
torchrun the launcher exits 1 whatever its ranks did, so the parent also reads the
ranks' error lines: a rank's own reason wins over the "another rank rejected" line the
others print.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from laplace.config import Config, config_from_dict
from laplace.errors import INPUT_ERROR_EXIT, Failure, InputError, PeerInputError

PEER_MARK = " (from another rank)"  # on the error line of a rank stopped by another rank's InputError


class WorkerFailed(Failure):
    """A stage worker crashed or was killed (not bad input): worth a retry."""

    def __init__(self, message: str, exit_status: int):
        super().__init__(message)
        self.exit_status = exit_status


# Where each compiler keeps its cache: Inductor's (CPU, CUDA) and TorchNeuron's native NEFF cache.
CACHE_ENV = ("TORCHINDUCTOR_CACHE_DIR", "TORCH_NEURONX_NEFF_CACHE_DIR")


def compile_env(cache_dir: Path | None) -> dict[str, str]:
    """Environment of a worker process whose compile cache lives in `cache_dir` (None: no cache)."""
    from laplace.pipeline.repro import subprocess_env

    env = subprocess_env()
    for name in CACHE_ENV:
        env.pop(name, None)
    if cache_dir is not None:
        for name in CACHE_ENV:
            env[name] = str(cache_dir)
    else:
        env["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"
        env["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "0"
    return env


def run_worker(
    module: str,
    cfg: Config,
    args: list[str],
    env: dict[str, str],
    cwd: Path,
    out: Path,
    launcher: list[str] | None = None,
) -> dict:
    """Run `python -m module` on the effective config; its result is the JSON it writes to `out`.
    `launcher` replaces `python` (e.g. torchrun's command line, from laplace.distributed)."""
    from laplace.fileio import atomic_write_json
    from laplace.pipeline.repro import run_streaming

    cfg_file = out.with_suffix(".config.json")
    atomic_write_json(cfg_file, cfg.to_dict())
    cmd = [*(launcher or [sys.executable]), "-m", module, "--config-json", str(cfg_file), "--out", str(out), *args]
    name = module.rsplit(".", 1)[-1]
    error_line = re.compile(rf"^{re.escape(name)}\.py: error(?P<peer>{re.escape(PEER_MARK)})?: (?P<reason>.+)$")
    own, peer = [], []

    def on_line(line: str) -> None:
        print(f"  [{name}] {line}", flush=True)
        if m := error_line.match(line):
            (peer if m["peer"] else own).append(m["reason"])

    status, tail = run_streaming(cmd, cwd, env, on_line)
    if status != 0:
        from laplace.processes import AGENT_FAILED_MARK as FAILED_MARK  # torchrun's agent: its verdict on a dead rank

        lines = tail.splitlines()
        verdicts = [line[len(FAILED_MARK) :] for line in lines if line.startswith(FAILED_MARK)]
        last = verdicts[-1] if verdicts else lines[-1] if lines else ""
        if status == INPUT_ERROR_EXIT or own or peer:
            raise InputError((own or peer or [last.split(": error: ", 1)[-1]])[0])
        how = f"killed by signal {-status}" if status < 0 else f"exit status {status}"
        raise WorkerFailed(f"{module} worker failed ({how}): {last}", status)
    return json.loads(out.read_text())


def run_worker_from_warmup_cache(module: str, cfg: Config, args: list[str], warmup_cache: Path) -> dict:
    """`run_worker` in a scratch directory, starting from a copy of the warmup stage's compile
    cache: the worker uses the graphs warmup compiled, and the artifact itself stays untouched."""
    name = module.rsplit(".", 1)[-1]
    with tempfile.TemporaryDirectory(prefix=f"laplace-{name}-") as tmp:
        cache = Path(tmp) / "cache"
        shutil.copytree(warmup_cache, cache)
        return run_worker(module, cfg, args, compile_env(cache), Path.cwd(), Path(tmp) / f"{name}.json")


def worker_main(
    description: str,
    body: Callable[[Config, argparse.Namespace], dict],
    argv: list[str] | None = None,
    paths: tuple[str, ...] = (),
    options: dict[str, dict] | None = None,
    summary: Callable[[dict], str] | None = None,
) -> int:
    """The child side: `--config-json` and `--out`, plus required `paths` (as Path) and
    `options` (argparse keywords; required unless they say otherwise); `body(cfg, args)` makes
    the result, written atomically. Under torchrun every rank runs the body; the first rank
    of each node writes the result (every node's parent reads one), rank 0 prints the summary."""
    from laplace.fileio import atomic_write_json

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--out", required=True)
    for name in paths:
        parser.add_argument(f"--{name}", required=True, type=Path)
    for name, keywords in (options or {}).items():
        parser.add_argument(f"--{name}", **{"required": True, **keywords})
    args = parser.parse_args(argv)
    try:
        cfg = config_from_dict(json.loads(Path(args.config_json).read_text()))
        result = body(cfg, args)
    except InputError as exc:  # the parent turns exit status 2 back into an InputError with this line
        mark = PEER_MARK if isinstance(exc, PeerInputError) else ""
        print(f"{parser.prog}: error{mark}: {exc}", file=sys.stderr, flush=True)
        return INPUT_ERROR_EXIT
    except Failure as exc:  # not the input's fault: one line (not "error", which means bad input) and a retry
        print(f"{parser.prog}: failed: {exc}", file=sys.stderr, flush=True)
        return exc.exit_status if exc.exit_status > 0 else 1
    # every node's parent waits for the result: each node's first rank writes it (ranks agree on it)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        atomic_write_json(args.out, result)
        if summary is not None and int(os.environ.get("RANK", "0")) == 0:
            print(summary(result), flush=True)
    return 0
