"""Ahead-of-time compiled serving graphs (serving/aot.py): a package built by warmup loads in another
engine without tracing (at its warmup, or at a shape's first use where warmup did not run), runs
that engine's own weights and state rows (read and written in place),
and gives the tokens of the eager engine, greedy and seeded, on a hybrid with a K/V cache; a
package built for anything else (another width, vocabulary, thread count, model) is never found,
and a failed build leaves no package."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_model_runner import MAX_CONTEXT, full_forward_greedy, hybrid, requests

from laplace.config import EngineSection
from laplace.runtime import compiled_graph_count, configure_compiler
from laplace.serving import aot
from laplace.serving.engine import DecodeEngine
from laplace.serving.replay import replay
from laplace.serving.scheduler import Request


def engine(m, compile_scope="model"):
    params = dataclasses.replace(
        EngineSection(),
        max_slots=2,
        widths=[2],
        prefill_buckets=[16],
        max_prompt_tokens=48,
        max_context=MAX_CONTEXT,
        compile_scope=compile_scope,
        prefix_cache_bytes=0,
    )
    return DecodeEngine(m, params, "padded", compiled=compile_scope is not None)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "compile-cache"))
    return tmp_path / "compile-cache"


@pytest.mark.slow  # two package builds of a 3-layer hybrid, about a minute on 2 cores
def test_a_package_loads_without_tracing_and_serves_what_the_eager_engine_serves(cache_dir):
    built = engine(hybrid(seed=0))
    configure_compiler(built.runner.graphs_needed())
    built.runner.warmup(build_packages=True)
    assert (built.runner.warmup_report["compiled"], built.runner.warmup_report["loaded_from_cache"]) == (2, 0)
    assert len(list((cache_dir / aot.PACKAGE_DIR).glob("*.pt2"))) == 2

    # another engine, other weights (the package holds none): loaded, nothing traced or compiled
    m = hybrid(seed=1)
    warm = engine(m)
    traced = compiled_graph_count()
    log = []
    warm.runner.warmup(log=log.append)
    assert (warm.runner.warmup_report["loaded_from_cache"], warm.runner.warmup_report["compiled"]) == (2, 0), log
    assert "decode width 2 loaded its ahead-of-time package" in "\n".join(log)
    assert compiled_graph_count() == traced  # Dynamo traced nothing

    # greedy: the training forward of these weights; seeded sampling: the eager engine's draws
    reqs = requests(seed=1, n=5)
    done = replay(warm, reqs)
    assert not any(s.compiled for s in warm.scheduler.steps)
    for req, c in zip(reqs, done):
        assert c.output_ids == full_forward_greedy(m, req.prompt_ids, req.max_new_tokens)[0], req.id
    sampled = [
        Request(r.id, r.prompt_ids, r.max_new_tokens, temperature=0.8, top_p=0.9, seed=r.id, repetition_penalty=1.2)
        for r in reqs
    ]
    warm.reset()
    eager = engine(m, compile_scope=None)
    assert [c.output_ids for c in replay(warm, sampled)] == [c.output_ids for c in replay(eager, sampled)]

    # an engine that never ran warmup (the numerics worker's) finds the package at a shape's first
    # use; the state rows are the engine's own memory: one decode step writes them in place, as eager does
    lazy = engine(m)
    traced = compiled_graph_count()
    with torch.inference_mode():
        for eng in (lazy, eager):
            eng.reset()
            torch.manual_seed(5)
            for t in (eng.cache.state.recurrent, eng.cache.state.conv, eng.cache.state.keys, eng.cache.state.values):
                t.normal_() if t is not None else None
        before = eager.cache.state.recurrent.clone()
        logits = [eng.runner.decode_rows([0, 1], [3, 7], 2) for eng in (lazy, eager)]
        torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)  # fp32, two schedules of one sum
        torch.testing.assert_close(lazy.cache.state.recurrent, eager.cache.state.recurrent, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            lazy.cache.state.keys, eager.cache.state.keys, rtol=1e-5, atol=1e-5
        )  # the K/V cache too
        assert not torch.equal(eager.cache.state.recurrent, before)
    assert compiled_graph_count() == traced and ("decode", 2) in lazy.runner._loaded


def test_the_fingerprint_holds_what_the_graph_was_built_for_and_not_the_weights():
    m = hybrid(seed=0)
    graphs = engine(m, compile_scope=None).runner.graphs
    ints, floats = torch.zeros(6, 2, dtype=torch.long), torch.zeros(5, 2)
    key = aot.fingerprint(graphs, "decode", 2, (ints, floats))
    other_weights = engine(hybrid(seed=1), compile_scope=None).runner.graphs
    assert aot.fingerprint(other_weights, "decode", 2, (ints, floats)) == key
    other_init = hybrid(seed=1)
    other_init.cfg = dataclasses.replace(other_init.cfg, init_std=0.02)  # decides weights only
    assert aot.fingerprint(engine(other_init, compile_scope=None).runner.graphs, "decode", 2, (ints, floats)) == key
    wider = (torch.zeros(6, 4, dtype=torch.long), torch.zeros(5, 4))
    assert aot.fingerprint(graphs, "decode", 4, wider) != key
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)  # in Inductor's generated C++: another package
        assert aot.fingerprint(graphs, "decode", 2, (ints, floats)) != key
    finally:
        torch.set_num_threads(threads)
    from test_model_runner import VOCAB

    from laplace.model.lm import LaplaceLM

    from project import tiny_model_config

    torch.manual_seed(0)
    bigger_vocab = LaplaceLM(tiny_model_config(VOCAB + 1, n_layers=3, init_std=0.3, attn=m.cfg.attn)).eval()
    assert aot.fingerprint(engine(bigger_vocab, compile_scope=None).runner.graphs, "decode", 2, (ints, floats)) != key
    gla_only = engine(hybrid(attn=None), compile_scope=None).runner.graphs
    assert aot.fingerprint(gla_only, "decode", 2, (ints, floats)) != key


def test_packages_apply_to_compiled_engines_with_inductor_on_cpu_only():
    cpu = torch.device("cpu")
    assert aot.applies(cpu, "inductor", compiled=True)
    assert not aot.applies(cpu, "inductor", compiled=False)  # eager
    assert not aot.applies(torch.device("cuda"), "inductor", compiled=True)  # CUDA graphs: torch.compile's
    assert not aot.applies(cpu, "neuron", compiled=True)  # Neuron's NEFF cache


def test_a_failed_build_leaves_no_package(tmp_path, monkeypatch):
    graphs = engine(hybrid(seed=0), compile_scope=None).runner.graphs
    args = (torch.zeros(6, 2, dtype=torch.long), torch.zeros(5, 2))
    path = aot.package_path(tmp_path, "decode", 2, aot.fingerprint(graphs, "decode", 2, args))

    def killed(*_args, package_path, **_kwargs):  # the compiler dies after writing part of the file
        open(package_path, "wb").write(b"partial")
        raise RuntimeError("g++ killed")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", killed)
    with pytest.raises(RuntimeError, match="g\\+\\+ killed"):
        aot.build(graphs, "decode_step", args, path)
    assert list(tmp_path.iterdir()) == []  # neither the package nor its partial file
