"""RULER's tasks of lm-eval as laplace.evals.ruler runs them: lm-eval's own generators and
scoring, a few samples instead of 500, every task in a child process under a timeout."""

from __future__ import annotations

import importlib
import os

import psutil
import pytest

from laplace.evals import ruler

TASKS = ["niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_cwe", "ruler_fwe"]


def test_every_task_of_the_comparison_has_a_dataset_function_to_size():
    for task in TASKS:
        source, module, function = ruler.task_source(task)
        assert source.name.endswith(".yaml") and module in ruler.GENERATORS, (task, module)
        assert callable(getattr(importlib.import_module(f"lm_eval.tasks.ruler.{module}"), function))
    with pytest.raises(ValueError, match="'niah_single_9' is not a RULER task of lm-eval 0.4.13"):
        ruler.task_source("niah_single_9")


def test_capped_datasets_are_lm_evals_own_samples_at_the_asked_count(tiny_artifacts, tmp_path):
    """Three samples per task at 1,024 tokens, each within the length by the export's tokenizer,
    each needle's answer in its prompt; lm-eval's generator is put back afterwards."""
    from transformers import AutoTokenizer

    _, export_dir = tiny_artifacts
    tokenizer_dir = ruler.tokenizer_dir(export_dir, tmp_path / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    for task in ("niah_single_1", "niah_multikey_2", "ruler_cwe"):
        _, module, function = ruler.task_source(task)
        mod = importlib.import_module(f"lm_eval.tasks.ruler.{module}")
        generator = getattr(mod, ruler.GENERATORS[module])
        rows = ruler.capped_dataset(
            module, function, num_samples=3, max_seq_lengths=[1024], tokenizer=str(tokenizer_dir)
        )["test"]
        assert getattr(mod, ruler.GENERATORS[module]) is generator
        assert len(rows) == 3 and {row["max_length"] for row in rows} == {1024}, task
        for row in rows:
            assert len(tokenizer(row["input"]).input_ids) <= 1024, task
            if task.startswith("niah"):
                assert all(answer in row["input"] for answer in row["outputs"]), task


def test_tasks_score_through_lm_eval_and_one_that_never_finishes_is_killed(tiny_artifacts):
    """At 512 tokens of the tests' 400-token vocabulary VT's few-shot example alone nearly fills
    the length, and lm-eval's VT generator retries forever: it is killed at the timeout with its
    child's process group, and a fresh child scores the task after it."""
    _, export_dir = tiny_artifacts
    tasks = ["niah_single_1", "ruler_vt", "niah_multikey_2"]
    # 30 s of a task's own time (the child's start-up: imports and lm-eval's word lists, 20-70 s on a
    # loaded machine, is bounded apart): each NIAH task here took 2.4-4.0 s at load 4 (2026-12-04), so
    # a 7x margin; VT never finishes, whatever the bound, and spins a core until it is killed
    result = ruler.run_tasks(export_dir, tasks, [512], samples=2, timeout_s=30)
    assert list(result) == tasks
    for task in ("niah_single_1", "niah_multikey_2"):
        assert result[task]["run"] is True and result[task]["samples"] == 2, result[task]
        assert 0.0 <= result[task]["score"]["512"] <= 1.0 and set(result[task]["score"]) == {"512"}
    assert result["ruler_vt"] == {
        "run": False,
        "reason": "did not finish in 30 s (compare.lm_eval_timeout_s; lm-eval's generators loop when their "
        "shortest prompt does not fit 512 tokens of this tokenizer)",
    }
    children = psutil.Process(os.getpid()).children(recursive=True)
    assert not [p for p in children if "laplace.evals.ruler" in " ".join(p.cmdline())], children
