"""One compile, loaded everywhere: the warmup stage ships the serving graphs of the tiny model as
ahead-of-time packages (serving/aot.py); its warm start, a fresh process, loads them in at most a
tenth of the cold start's CPU-seconds; a `laplace serve` started after it loads every graph
without tracing, says so in its log and /metrics, and serves a shared system prompt through the
state prefix cache with the same greedy tokens as the eager engine without it."""

from __future__ import annotations

import os

import httpx
import pytest
import torch

from laplace.data.shards import read_manifest
from laplace.model.config import preset_model_config
from laplace.model.export import load_export
from laplace.model.lm import LaplaceLM
from laplace.pipeline.params import load_config
from laplace.pipeline.serve import ServerProcess
from laplace.pipeline.stage_serve_check import scrape
from laplace.pipeline.stage_warmup import warm_up
from laplace.serving.engine import DecodeEngine
from laplace.serving.scheduler import Request
from laplace.serving.warmup import SETTINGS_FILE, settings_mismatch

from project import ROOT, write_model_export

SERVE = {
    # the tiny preset, the model the warm-start bound is stated for (its weights: the export below)
    "model.preset": "tiny",
    "engine.max_slots": 2,  # decode widths 1, 2 and one prefill bucket: three graphs
    "engine.prefill_buckets": [64],
    "engine.max_prompt_tokens": 64,
    "engine.prefix_cache_min_tokens": 8,
    "server.threads": 1,
}


def test_settings_mismatch_names_the_thread_count(tmp_path):
    from laplace.serving.warmup import record_compile_settings

    record_compile_settings(tmp_path, {"threads": 2, "torch": "2.13.0"})
    assert settings_mismatch(tmp_path, {"threads": 2, "torch": "2.13.0"}) is None
    why = settings_mismatch(tmp_path, {"threads": 1, "torch": "2.13.0"})
    assert "threads 2 there, 1 here" in why and "every graph will compile" in why
    assert "--set server.threads=2 as warmup had it" in why  # the knob, with the value that matches
    other_torch = settings_mismatch(tmp_path, {"threads": 2, "torch": "2.14.0"})
    assert "torch 2.13.0 there, 2.14.0 here" in other_torch and "--set" not in other_torch  # no knob for that
    assert settings_mismatch(tmp_path / "none", {"threads": 1}) is None  # a cache that says nothing


@pytest.mark.slow
def test_a_server_started_after_warmup_compiles_nothing(tiny_artifacts, tmp_path, monkeypatch):
    data_dir, trained = tiny_artifacts
    cfg = load_config(ROOT / "params.yaml", SERVE)
    vocab = read_manifest(data_dir)["vocab_size"]
    torch.manual_seed(0)  # wide logits (init_std 0.3): no near-ties for greedy between graph and eager
    untrained = LaplaceLM(preset_model_config("tiny", vocab_size=vocab, init_std=0.3)).eval()
    export_dir = write_model_export(untrained, trained / "tokenizer.json", tmp_path / "export")
    cache = tmp_path / "compile-cache"
    # the warmup stage's function: a cold and then a warm worker, fresh processes, at torch's default
    # thread count in their environment (no OMP_NUM_THREADS): before server.threads applied there,
    # they compiled at the machine's core count and the 1-thread server below recompiled everything
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    # the bound is against a cold compile: plain g++, not the outputs the suite's compiler keeps, and
    # Inductor's CPU-feature probe in the new cache, which the rest of the suite skips (conftest)
    monkeypatch.setenv("LAPLACE_CXX_CACHE", "")
    monkeypatch.delenv("TORCHINDUCTOR_VEC_ISA_OK", raising=False)
    metrics = warm_up(cfg, cache, vocab, tmp_path / "scratch")
    assert metrics["graphs"] == metrics["packages"] == metrics["warm_loaded_from_cache"] == 3, metrics
    assert metrics["threads"] == 1 and (cache / SETTINGS_FILE).is_file()
    # the bound, in CPU-seconds of each worker's process tree (measured side by side here)
    assert metrics["warm_cpu_fraction"] <= 0.10, (metrics["cold_cpu_s"], metrics["warm_cpu_s"])

    model, tokenizer, _ = load_export(export_dir)
    system = tokenizer.encode("The function returns the value of the key in the table, and then").ids
    prompts = [system + tokenizer.encode(f" {word} more text").ids for word in ("red", "green", "blue", "cold")]
    server_env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with ServerProcess(cfg, model=export_dir, policy="padded", compile_cache=cache, env=server_env) as server:
        server.wait_ready(cfg.serve_check.live_startup_s)
        outputs = []
        for prompt in prompts:  # one at a time: each admission sees the cache the last one left
            body = {"model": cfg.tracking.model_name, "prompt": prompt, "max_tokens": 6, "temperature": 0}
            r = httpx.post(server.url + "/v1/completions", json=body | {"ignore_eos": True}, timeout=60)
            assert r.status_code == 200, r.text
            outputs.append(r.json()["choices"][0]["text"])
        counters = scrape(server.url)
        assert server.stop() == 0
    log = "\n".join(server.lines)
    assert counters["laplace_warmup_graphs"] == counters["laplace_warmup_graphs_loaded_from_cache"] == 3, log
    assert counters["laplace_compile_events_total"] == 0
    assert log.count("loaded its ahead-of-time package") == 3, log  # no graph traced
    # the shared system prompt under one prefill bucket: a split where the prompts diverge cannot save
    # a bucket (the rest fills the same one), so none is made (it would cost request 1 a second piece
    # for nothing) and every request misses; the prompts are still looked up, in tokens
    hits = {k: v for k, v in counters.items() if k.startswith("laplace_prefix_cache_hits")}
    misses = {k: v for k, v in counters.items() if k.startswith("laplace_prefix_cache_misses")}
    assert list(hits.values()) == [0.0] and list(misses.values()) == [4.0], counters
    queries = {k: v for k, v in counters.items() if k.startswith("vllm:prefix_cache_queries")}
    assert list(queries.values()) == [float(sum(len(p) for p in prompts))], counters
    assert "loaded from cache 3/3, compiled 0" in log and "was built under other settings" not in log
    assert "3/3 graphs loaded from the compile cache, 0 compiled" in log  # the server's ready line

    # greedy through the compiled engine and its prefix cache = the eager engine without a cache
    eager = DecodeEngine(model, cfg.engine, "eager")
    eager.cache.prefix_cache.budget_bytes = 0
    done = eager.complete([Request(i, p, 6) for i, p in enumerate(prompts)])
    assert outputs == [tokenizer.decode(c.output_ids) for c in done]


def test_a_server_without_a_warmup_cache_compiles_into_a_scratch_cache_of_its_own(tmp_path, monkeypatch):
    """Never the user's shared default Inductor cache: an empty directory under the server's scratch."""
    from laplace.pipeline.serve import use_compile_cache
    from laplace.pipeline.workers import CACHE_ENV

    for name in CACHE_ENV:
        monkeypatch.delenv(name, raising=False)
    assert use_compile_cache(tmp_path / "no-such-cache", tmp_path, "padded") is None
    for name in CACHE_ENV:
        assert os.environ[name] == str(tmp_path / "compile-cache")
    assert (tmp_path / "compile-cache").is_dir() and not any((tmp_path / "compile-cache").iterdir())
    import torch._inductor.runtime.cache_dir_utils as cache_dirs

    assert cache_dirs.cache_dir() == str(tmp_path / "compile-cache")  # what Inductor will write into


@pytest.mark.slow
def test_sigterm_during_warmup_ends_within_2_s_and_leaves_no_compiler_running(tiny_artifacts, tmp_path):
    """A server compiling cold (no warmup cache) gets SIGTERM once warmup has started: the process
    ends within 2 s with exit 0, no process it started (g++, Inductor's compile workers) outlives it,
    and the log has no compiler output or traceback."""
    import signal
    import time

    import psutil

    from laplace.pipeline.repro import subprocess_env

    _, export_dir = tiny_artifacts
    cfg = load_config(ROOT / "params.yaml", {"engine.max_slots": 2, "engine.prefill_buckets": [16]})
    env = subprocess_env({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    server = ServerProcess(
        cfg, model=export_dir, policy="padded", compile_cache=tmp_path / "none", root=tmp_path, env=env
    ).start()
    try:
        deadline = time.monotonic() + 180
        while not any("warmup 1/" in line for line in server.lines) and time.monotonic() < deadline:
            assert server.proc.poll() is None, "\n".join(server.lines)
            time.sleep(0.1)
        time.sleep(3.0)  # into the compile: Dynamo tracing, then g++
        started = psutil.Process(server.proc.pid).children(recursive=True)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        status = server.proc.wait(timeout=30)
        elapsed = time.monotonic() - t0
    finally:
        server.stop()
    time.sleep(0.5)
    alive = [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    log = "\n".join(server.lines)
    assert elapsed < 2.0, (elapsed, log[-2000:])
    assert status == 0 and not alive, (status, alive)
    assert "Traceback" not in log and "g++" not in log and len(server.lines) < 60, log[-3000:]
    assert "SIGTERM during warmup: stopping" in log
