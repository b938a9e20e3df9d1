"""The tokenize stage's slices fanned out over a real Dask cluster (two worker processes on
loopback) through the Prefect flow in flows/tokenize.py: the shards are byte-identical to the
local pool's, and the manifest is written by the final merge in the flow's process."""

from __future__ import annotations

import json

import pytest

from laplace.config import DataSection, TokenizerSection
from laplace.data.pydocs import python_docs_documents
from laplace.data.tokenize import tokenize_corpus
from laplace.data.tokenizer import train_tokenizer

pytestmark = pytest.mark.slow


def test_dask_fan_out_gives_the_local_runs_shards_byte_for_byte(tmp_path, monkeypatch):
    from distributed import Client, LocalCluster, get_task_stream
    from prefect.testing.utilities import prefect_test_harness
    from prefect_dask import DaskTaskRunner

    from flows.tokenize import tokenize

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the Dask workers inherit it
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect-home"))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    docs = python_docs_documents()
    for i in range(12):
        (corpus / f"part-{i}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[i::12][:60]))
    tok = tmp_path / "tokenizer.json"
    train_tokenizer(docs[:200], 600, 2).save(str(tok))
    data = {"source": "files", "path": str(corpus), "slices": 4, "shard_tokens": 20_000, "num_proc": 2}
    (tmp_path / "params.yaml").write_text(
        json.dumps({"seed": 0, "data": data, "tokenizer": {"path": str(tok)}})
    )  # YAML too
    local = tmp_path / "local"
    expected = tokenize_corpus(DataSection(**data), TokenizerSection(path=str(tok)), local, 0)

    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=None
        ) as cluster,
        Client(cluster) as client,
        prefect_test_harness(server_startup_timeout=120),
    ):
        fanned = tmp_path / "fanned"
        flow = tokenize.with_options(task_runner=DaskTaskRunner(address=cluster.scheduler_address))
        with get_task_stream(client) as stream:
            metrics = flow(root=str(tmp_path), out_dir=str(fanned))
    workers = {t["worker"] for t in stream.data}
    assert metrics["slices"] == expected["slices"] >= 3 and metrics["slices_reused"] == 0
    assert len(workers) == 2, stream.data  # both Dask workers encoded slices
    names = sorted(p.relative_to(local) for p in local.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(fanned) for p in fanned.rglob("*") if p.is_file())
    for name in names:
        assert (fanned / name).read_bytes() == (local / name).read_bytes(), name
