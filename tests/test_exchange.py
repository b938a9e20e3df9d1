"""bench/muon_comm.py under real torchrun/gloo: every rank's metered Muon bytes equal `laplace plan`'s,
and the bytes of a whole training step, counted on every collective, are the plan's within 5%."""

from __future__ import annotations

import json
import sys

import pytest

from project import ROOT, env, run


@pytest.mark.slow
def test_measured_alltoall_bytes_per_rank_at_2_and_4_ranks_equal_the_plan(tmp_path):
    out = run(
        [sys.executable, "bench/muon_comm.py", "--worlds", "2", "4", "--steps", "1"]
        + ["--d-model", "64", "--layers", "2", "--vocab", "256"],
        cwd=ROOT,
        env=env(OMP_NUM_THREADS="1"),
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    runs = {r["world_size"]: r for r in result["runs"]}
    assert sorted(runs) == [2, 4]
    for r in runs.values():
        # min, mean and max over the ranks, both strategies: exactly the plan's bytes
        assert r["bytes_equal_the_plan"], r
        assert r["bytes_per_rank_alltoall"] == r["plan_bytes_per_rank_alltoall"] > 0, r
        assert r["bytes_per_rank_allgather"] == r["plan_bytes_per_rank_allgather"] > 0, r
    assert runs[4]["bytes_per_rank_alltoall"] < runs[4]["bytes_per_rank_allgather"]
    big = result["laplace_3b_at_64_ranks"]
    assert big["alltoall_bytes_per_rank"] <= 0.42e9 < big["article_alltoall_bytes"]
    # a whole step (forward, backward, optimizer), counted on every collective call, per mode and
    # rank, against laplace plan's per-kind arithmetic (laplace.training.plan.step_traffic)
    for n, r in runs.items():
        for comm in ("owner_reduce", "alltoall"):
            kinds = r["step_bytes"][comm]
            assert kinds["worst_relative_error"] <= 0.05, (n, comm, kinds)
            for kind in ("gradients", "parameters"):
                assert all(m > 0 for m in kinds[kind]["measured"]), (n, comm, kind)
        assert r["step_bytes"]["owner_reduce"]["optimizer"]["measured"] == [0] * n  # no exchange of its own
        assert all(m > 0 for m in r["step_bytes"]["alltoall"]["optimizer"]["measured"])
        owner, a2a = (sum(r["step_bytes"][c]["total"]["measured"]) for c in ("owner_reduce", "alltoall"))
        assert owner < a2a, (n, owner, a2a)  # one broadcast per step where FSDP2 gathers twice
