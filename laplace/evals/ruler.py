"""RULER's synthetic tasks (lm-evaluation-harness) at a sample count of our choosing.

lm-eval 0.4.13's RULER dataset functions generate 500 samples per task and length before
`limit` applies, each sized by tokenizing its haystack: on a 2-core CPU that is minutes per
task for the 4 samples the comparison scores. `write_task_dir` writes, for each task, a YAML
that includes lm-eval's own under the same name (TaskManager gives its `include_path`
precedence) and swaps only its dataset function for `capped_dataset`: lm-eval's own function,
run with its sample generator's count capped at the `num_samples` of the task metadata. The
prompts, answers and scoring stay lm-eval's; only how many samples exist changes.

`run_tasks` runs the tasks in a child process (`python -m laplace.evals.ruler`), each under a timeout:
some of lm-eval's generators loop forever when their shortest prompt does not fit the length
(VT retries its noise count in a `while True` under a bare `except`, which no signal can break
into), so a task that cannot finish is killed and reported as not run, with the reason.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from laplace.processes import child_dies_with_us

# each RULER module's sample generator: the function its dataset functions call with num_samples
GENERATORS = {
    "niah_utils": "generate_samples",
    "vt_utils": "sys_vartrack_w_noise_random",
    "cwe_utils": "sys_word_pair_random",
    "fwe_utils": "get_dataset",
    "qa_utils": "generate_samples",
}
SHIM = "laplace_ruler"  # the module the YAMLs' !function tags name, beside them


def ruler_dir() -> Path:
    import lm_eval

    return Path(lm_eval.__file__).parent / "tasks" / "ruler"


def task_source(task: str) -> tuple[Path, str, str]:
    """(lm-eval's YAML of `task`, the module and the function of its custom_dataset)."""
    for path in sorted(ruler_dir().glob("*.yaml")):
        text = path.read_text()
        if re.search(rf"^task:\s*{re.escape(task)}\s*$", text, re.M):
            found = re.search(r"^custom_dataset:\s*!function\s+(\w+)\.(\w+)\s*$", text, re.M)
            if found and found.group(1) in GENERATORS:
                return path, found.group(1), found.group(2)
            raise ValueError(f"RULER task {task!r}: {path.name} names no dataset function this module can size")
    raise ValueError(f"{task!r} is not a RULER task of lm-eval {_lm_eval_version()} (lm_eval/tasks/ruler/*.yaml)")


def _lm_eval_version() -> str:
    from importlib.metadata import version

    return version("lm_eval")


def capped_dataset(module: str, function: str, num_samples: int, **kwargs) -> dict:
    """lm-eval's `ruler/<module>.<function>(**kwargs)` with every call of the module's sample
    generator asking for at most `num_samples` (lm-eval's own calls ask for 500; the few-shot
    example VT draws asks for 1)."""
    mod = importlib.import_module(f"lm_eval.tasks.ruler.{module}")
    name = GENERATORS[module]
    generate = getattr(mod, name)

    def capped(*args, **kw):
        kw["num_samples"] = min(kw.get("num_samples", num_samples), num_samples)
        return generate(*args, **kw)

    setattr(mod, name, capped)
    try:
        return getattr(mod, function)(**kwargs)
    finally:
        setattr(mod, name, generate)


def write_task_dir(tasks: list[str], lengths: list[int], out: Path) -> Path:
    """A directory for TaskManager's include_path: one YAML per task (lm-eval's, its dataset
    function capped, a metric per length in `lengths` besides lm-eval's default one) and the
    module its !function tags name."""
    from lm_eval.tasks.ruler.common_utils import DEFAULT_SEQ_LENGTHS

    out.mkdir(parents=True, exist_ok=True)
    shim = [
        "from laplace.evals.ruler import capped_dataset",
        "from lm_eval.tasks.ruler.common_utils import aggregate_metrics",
        "",
    ]
    # process_results scores every length of DEFAULT_SEQ_LENGTHS (-1 where absent): each needs its metric
    metrics = sorted({*DEFAULT_SEQ_LENGTHS, *lengths})
    for task in tasks:
        source, module, function = task_source(task)
        shim += [f"def {task}(**kwargs):", f"    return capped_dataset({module!r}, {function!r}, **kwargs)", ""]
        metric_list = "".join(
            f'  - metric: "{n}"\n    aggregation: !function {SHIM}.aggregate_metrics\n    higher_is_better: true\n'
            for n in metrics
        )
        (out / f"{task}.yaml").write_text(
            f"include: {source}\ntask: {task}\ncustom_dataset: !function {SHIM}.{task}\nmetric_list:\n{metric_list}"
        )
    (out / f"{SHIM}.py").write_text("\n".join(shim))
    return out


def scores(task_results: dict, lengths: list[int]) -> dict[str, float]:
    """The score at each of `lengths` from lm-eval's results for one task ({"1024,none": 0.25, ...})."""
    return {str(n): task_results[f"{n},none"] for n in lengths if f"{n},none" in task_results}


def tokenizer_dir(export_dir: Path, out: Path) -> Path:
    """RULER sizes its synthetic prompts with transformers' AutoTokenizer, which loads a directory
    holding tokenizer_config.json: the export's own tokenizer.json as a PreTrainedTokenizerFast."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(Path(export_dir) / "tokenizer.json", out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return out


GEN_TOKENS = 256  # room for the longest answer lm-eval's RULER tasks generate (max_gen_toks 128)


def evaluate_task(export_dir: Path, task: str, lengths: list[int], samples: int, scratch: Path) -> dict:
    """One task through lm-eval and the engine, in this process: {"score": {length: fraction}}."""
    from laplace.evals.harness import evaluate

    results = evaluate(
        export_dir,
        [task],
        include_path=str(write_task_dir([task], lengths, scratch / "tasks")),
        limit=samples,
        # eager: compiling the ladder's graphs costs more than a few samples' decode steps
        model_args={"compile": False, "max_slots": 4, "max_context": max(lengths) + GEN_TOKENS},
        metadata={
            "max_seq_lengths": lengths,
            "tokenizer": str(tokenizer_dir(export_dir, scratch / "tokenizer")),
            "num_samples": samples,
        },
        include_defaults=False,  # the task's YAML includes lm-eval's by its path: no index of every task
    )
    return {"score": scores(results.get("results", {}).get(task, {}), lengths)}


# the child's start-up, before its first task (imports), is bounded apart from the tasks' own timeout
STARTUP_TIMEOUT_S = 600.0


def run_tasks(export_dir: Path, tasks: list[str], lengths: list[int], samples: int, timeout_s: float) -> dict:
    """Every task in one child process (lm-eval and torch imported once), each killed with the
    child's whole process group when it runs past `timeout_s`; the child then starts again on
    the tasks left. Per task: its score per length, samples and seconds, or `run: false` and the
    reason it did not run."""
    done: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="laplace-ruler-") as scratch:
        out = Path(scratch) / "results.json"
        while left := [t for t in tasks if t not in done]:
            done.update(_child(export_dir, left, lengths, samples, timeout_s, out, Path(scratch) / "log.txt"))
    return {task: done[task] for task in tasks}


def _child(export_dir, tasks, lengths, samples, timeout_s, out: Path, log_path: Path) -> dict[str, dict]:
    """Run `tasks` in one child until it finishes, crashes or one task outlives `timeout_s`: the
    results it wrote, and the reason for the task it was on when it was stopped."""
    out.unlink(missing_ok=True)
    # lm-eval's RULER module downloads nltk's punkt_tab at import unless nltk finds it; none of these
    # tasks tokenizes sentences (only the essay haystacks do), so an empty stand-in keeps the child
    # off the network: a task that did need it fails, and is reported, instead of a download hanging
    nltk_data = out.parent / "nltk_data"
    (nltk_data / "tokenizers" / "punkt_tab").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "NLTK_DATA": str(nltk_data)}
    argv = [sys.executable, "-m", __name__, "--export", str(export_dir), "--out", str(out)]
    argv += ["--samples", str(samples), "--lengths", *map(str, lengths), "--tasks", *tasks]
    with open(log_path, "w+") as log:
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=child_dies_with_us(),
        )
        # the child's progress: the task it is on and the results so far; each change restarts the
        # clock. Until its first write the child is starting (lm-eval's and torch's imports: 20-45 s on a
        # loaded 2-core machine), bounded apart, so `timeout_s` is a task's own time
        progress, started, reason = None, time.monotonic(), None
        try:
            while proc.poll() is None:
                time.sleep(0.5)
                bound = timeout_s if progress is not None else STARTUP_TIMEOUT_S
                if out.exists() and (now := out.read_text()) != progress:
                    progress, started = now, time.monotonic()
                elif time.monotonic() - started > bound and progress is None:
                    reason = f"the child did not start in {STARTUP_TIMEOUT_S:g} s (its imports)"
                    break
                elif time.monotonic() - started > bound:
                    reason = (
                        f"did not finish in {timeout_s:g} s (compare.lm_eval_timeout_s; lm-eval's generators loop "
                        f"when their shortest prompt does not fit {max(lengths)} tokens of this tokenizer)"
                    )
                    break
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        results = json.loads(out.read_text())["results"] if out.exists() else {}
        if reason is None and proc.returncode != 0:
            log.seek(0)
            lines = [line for line in log.read()[-4000:].splitlines() if line.strip()]
            last = next((line for line in reversed(lines) if "Error" in line), lines[-1] if lines else "")
            reason = f"the child exited with status {proc.returncode}: {' '.join(last.split())[:300]}"
    current = next((t for t in tasks if t not in results), None)
    if current is not None:
        results[current] = {"run": False, "reason": reason or "the child stopped before this task"}
    return results


def _run_in_child(export_dir: Path, tasks: list[str], lengths: list[int], samples: int, out: Path) -> None:
    """The child's side: each task in turn; the task it is on and every result so far are written
    (atomically) at each task's start and end."""
    results: dict[str, dict] = {}

    def write(current: str | None) -> None:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps({"current": current, "results": results}))
        tmp.replace(out)

    for task in tasks:
        write(task)
        start = time.perf_counter()
        try:
            with tempfile.TemporaryDirectory() as scratch:
                figures = evaluate_task(export_dir, task, lengths, samples, Path(scratch))
            results[task] = {"run": True, **figures, "samples": samples, "seconds": time.perf_counter() - start}
        except Exception as exc:  # noqa: BLE001 - a task that cannot run offline is reported, not fatal
            reason = " ".join(str(exc).split())[:300] or type(exc).__name__
            results[task] = {"run": False, "reason": f"{type(exc).__name__}: {reason}"}
    write(None)


def ruler_modules(tasks: list[str]) -> set[str]:
    """The lm-eval RULER modules that generate `tasks`' data (a task that is not RULER's is left to
    fail, and be reported, in its own turn)."""
    modules = set()
    for task in tasks:
        try:
            modules.add(task_source(task)[1])
        except ValueError:
            continue
    return modules


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="RULER tasks of lm-eval on an export (run_tasks' child)")
    p.add_argument("--export", type=Path, required=True)
    p.add_argument("--tasks", nargs="+", required=True)
    p.add_argument("--lengths", type=int, nargs="+", required=True)
    p.add_argument("--samples", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # beside the comparison's other work on a shared machine
    import laplace.evals.harness  # noqa: F401  lm-eval's imports in the start-up, not in the first task's time

    # lm-eval's RULER modules build their word lists at import (prepare_niah: every adjective-noun
    # pair, sorted: 20-48 s on a loaded 2-core machine): start-up too, not the first task's time
    for module in sorted(ruler_modules(args.tasks)):
        importlib.import_module(f"lm_eval.tasks.ruler.{module}")
    _run_in_child(args.export, args.tasks, args.lengths, args.samples, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
