"""Training checkpoints under real torchrun/gloo ranks: resume by rank 0's step number, every rank
verifying its share, and DCP's async save put in place only when complete."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from project import env

HERE = Path(__file__).resolve().parent


@pytest.mark.slow
def test_resume_takes_rank_0s_step_and_async_saves_land_whole(tmp_path):
    out = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "laplace.training.launch", "--standalone", "--nproc-per-node=2"]  # torchrun
    cmd += [str(HERE / "checkpoint_worker.py"), str(tmp_path / "checkpoints"), str(out)]
    done = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True, timeout=300, env=env(OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    # async: not in place until finished, then whole, with the weights of the moment it was called
    assert report["async_in_place_before_close"] is False
    assert report["async_in_place_after_close"] is True and report["async_staging_left"] == []
    assert report["async_weights_as_at_save"] is True
    # one shard per rank, each hashed by its writer (no digest files left over)
    assert [n for n in report["manifest_files"] if n.startswith("shard-")] == [
        "shard-00001-model-00001-of-00001.safetensors",
        "shard-00002-model-00001-of-00001.safetensors",
    ]
    assert not [n for n in report["manifest_files"] if n.startswith(".")]
    # rank 1 listed a newer step_000009 of its own: both ranks still resume rank 0's newest, step 6
    assert report["stale_listing"] == [6, 6]
    # the newest's second file (verified by rank 1 alone) damaged: both fall back to step 4
    assert report["damaged_newest"] == [4, 4]
