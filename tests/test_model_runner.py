"""The decode engine serving a hybrid (GLA + softmax attention layers), and Gated DeltaNet models
(GDN + attention, all GDN) through the same tests: each slot's K/V cache, static shape up to
engine.max_context, decoding that equals the full forward across prefill buckets, ladder widths
and prefix-cache hits, the prefix cache holding K/V up to the junction, byte accounting against
the formula, a request longer than the context refused, and no compilation while serving after
warmup."""

import dataclasses

import numpy as np
import pytest
import torch

from laplace.config import EngineSection
from laplace.model.lm import LaplaceLM, State, analytic_state_bytes, sequence_bytes
from laplace.runtime import configure_compiler
from laplace.serving.engine import DecodeEngine
from laplace.serving.replay import replay
from laplace.serving.scheduler import Rejected, Request

from project import tiny_model_config

VOCAB = 97
MAX_CONTEXT = 64
ATTN = {"layers": [1], "num_heads": 4, "num_kv_heads": 2, "window_size": 24}
# Gated DeltaNet layers (model.gdn) of the 3-layer model: GVA (2 value heads per query/key head), Vh = 24
GDN_SPEC = {"num_heads": 1, "num_v_heads": 2, "head_dim": 16, "expand_v": 1.5}
ARCHS = {
    "gla+attn": {"attn": ATTN},
    "gdn+attn": {"attn": ATTN, "gdn": {"layers": [0, 2], **GDN_SPEC}},
    "gdn": {"attn": None, "gdn": {"layers": [0, 1, 2], **GDN_SPEC}},
}


def hybrid(seed=0, attn=ATTN, gdn=None):
    torch.manual_seed(seed)
    cfg = tiny_model_config(VOCAB, n_layers=3, init_std=0.3, attn=attn, gdn=gdn)  # wide logits: no near-ties
    return LaplaceLM(cfg).eval()


def engine(m, *, buckets=(8, 16), compile_scope=None, prefix_cache_bytes=0, backend=None):
    params = dataclasses.replace(
        EngineSection(),
        max_slots=4,
        widths=[1, 2, 4],
        prefill_buckets=list(buckets),
        max_prompt_tokens=48,
        max_context=MAX_CONTEXT,
        compile_scope=compile_scope or "block",
        prefix_cache_bytes=prefix_cache_bytes,
        prefix_cache_min_tokens=4,
    )
    return DecodeEngine(m, params, "padded", compiled=compile_scope is not None, backend=backend)


@torch.inference_mode()
def full_forward_greedy(m, prompt, n):
    """Greedy tokens and their logits by the training forward over the growing sequence."""
    seq, logits = list(prompt), []
    for _ in range(n):
        out = m(torch.tensor([seq]))[0, -1]
        logits.append(out)
        seq.append(int(out.argmax()))
    return seq[len(prompt) :], torch.stack(logits)


def requests(seed=0, n=9):
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, VOCAB, 20).tolist()  # a common prefix: the prefix cache splits and hits
    out = []
    for i in range(n):
        tail = rng.integers(0, VOCAB, int(rng.integers(1, 20))).tolist()
        prompt = shared[: int(rng.integers(5, 21))] + tail if i % 2 else tail + shared[:3]
        out.append(Request(i, prompt, int(rng.integers(2, 12)), arrival_s=0.001 * i))
    return out


@pytest.mark.parametrize(
    "arch,prefix_cache_bytes",
    [("gla+attn", 0), ("gla+attn", 1 << 22), ("gdn+attn", 0), ("gdn+attn", 1 << 22), ("gdn", 1 << 22)],
    ids=["no-prefix-cache", "prefix-cache", "gdn+attn-no-prefix-cache", "gdn+attn-prefix-cache", "gdn-prefix-cache"],
)
def test_engine_decoding_equals_the_full_forward(arch, prefix_cache_bytes):
    m = hybrid(**ARCHS[arch])
    eng = engine(m, prefix_cache_bytes=prefix_cache_bytes)
    logits: list[torch.Tensor] = []
    eng.on_logits = lambda rows: logits.append(rows.clone())
    reqs = requests()
    done = replay(eng, reqs)
    widths = {s.width for s in eng.scheduler.steps if s.kind == "decode"}
    assert widths <= {1, 2, 4} and len(widths) >= 2  # the ladder's widths, more than one of them
    prefills = [s for s in eng.scheduler.steps if s.kind == "prefill"]
    # prompts longer than the largest bucket went in chunks, one step each: more prefill steps than requests
    assert len(prefills) > len(reqs)
    for req, c in zip(reqs, done):
        assert c.status == "done", c.reason
        want, want_logits = full_forward_greedy(m, req.prompt_ids, req.max_new_tokens)
        assert c.output_ids == want, req.id
    if prefix_cache_bytes:
        stats = eng.cache.stats()
        assert stats["hits"] >= 1 and (stats["kv_bytes"] > 0) == bool(m.cfg.attn_layers), stats
        assert stats["bytes"] <= prefix_cache_bytes
    # logits of every engine step (prefill's first token included) against the full forward, fp32
    first = reqs[0]
    eng2 = engine(hybrid(**ARCHS[arch]), prefix_cache_bytes=prefix_cache_bytes)
    with eng2.cache.leased([0]) as (slot,):
        got = [eng2.runner.prefill(slot, first.prompt_ids)[0]]
        want, want_logits = full_forward_greedy(m, first.prompt_ids, 6)
        for token in want[:-1]:
            got.append(eng2.runner.decode_rows([slot], [token])[0])
    assert (torch.stack(got) - want_logits).abs().max() < 1e-4 * want_logits.abs().max()


def test_slots_hold_kv_up_to_max_context_by_the_formula_and_longer_requests_are_refused():
    m = hybrid()
    eng = engine(m)
    per_sequence = sequence_bytes(m.cfg, MAX_CONTEXT)
    alloc = eng.cache.allocation()
    # K and V, 64 positions, 2 kv heads of d_model/4, fp32
    assert alloc["kv_bytes_per_slot"] == per_sequence["kv_bytes"] == 2 * MAX_CONTEXT * 2 * (m.cfg.d_model // 4) * 4
    assert alloc["state_bytes_per_slot"] == per_sequence["state_bytes"]
    assert alloc["kv_bytes"] == 5 * per_sequence["kv_bytes"]  # 4 slots and the dummy
    assert eng.cache.bytes_per_slot == per_sequence["total_bytes"]
    assert eng.cache.memory()["slots_kv"] == alloc["kv_bytes"]
    with pytest.raises(Rejected, match="engine.max_context=64"):
        eng.scheduler.check(Request(0, [1] * 40, 25))
    eng.scheduler.check(Request(0, [1] * 40, 24))  # exactly the context: served
    # a GLA model has no context limit
    gla = engine(hybrid(attn=None))
    gla.scheduler.check(Request(0, [1] * 40, 1000))
    assert gla.cache.allocation()["kv_bytes"] == 0


@pytest.mark.parametrize("arch", ["gdn+attn", "gdn"])
def test_gdn_state_lives_in_the_slot_pool_by_the_formula(arch):
    """The pool's State holds each GDN layer's matrix state and conv cache per slot (the dummy
    included), sized by docs/model.md's formula; a slot's rows are the model's own state after its
    prompt (a fresh State's), other slots untouched, and zeroed when it is admitted again."""
    m = hybrid(**ARCHS[arch])
    eng = engine(m)
    cfg, state = m.cfg, eng.cache.state
    L, d, conv = len(cfg.gdn_layers), cfg.gdn_dims(), cfg.conv_size - 1
    assert (d["HV"], d["Kh"], d["Vh"], d["K"], d["V"]) == (2, 16, 24, 16, 48)
    assert state.delta.shape == (L, 5, 2, 16, 24) and state.delta.dtype == torch.float32  # 4 slots and the dummy
    assert state.delta_conv.shape == (L, 5, conv, 2 * 16 + 48)
    # L_gdn * (HV * (K/H) * (V/HV) * 4 + (conv_size - 1) * (2K + V) * itemsize), no GLA layer
    formula = L * (2 * 16 * 24 * 4 + conv * (2 * 16 + 48) * 4)
    assert len(cfg.gla_layers) == 0 and analytic_state_bytes(cfg) == formula
    alloc = eng.cache.allocation()
    assert alloc["state_bytes_per_slot"] == formula and alloc["state_bytes"] == 5 * formula
    assert eng.cache.bytes_per_slot == sequence_bytes(cfg, MAX_CONTEXT)["total_bytes"]
    assert (alloc["kv_bytes"] > 0) == (arch == "gdn+attn")
    if arch == "gdn":  # no attention layer: no context limit, as GLA
        eng.scheduler.check(Request(0, [1] * 40, 1000))
    prompt = list(range(3, 30))
    own = State.allocate(cfg, 1, max_context=MAX_CONTEXT)
    with torch.inference_mode():
        want = m.prefill(torch.tensor([prompt]), own)
    with eng.cache.leased([0, 1]) as (slot, other):
        got = eng.runner.prefill(slot, prompt)
        torch.testing.assert_close(got.view(want.shape), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(state.delta[:, slot], own.delta[:, 0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(state.delta_conv[:, slot], own.delta_conv[:, 0])
        assert state.delta[:, other].abs().max() == 0 and state.delta[:, eng.cache.dummy].abs().max() == 0
    with eng.cache.leased([2, 3, 4, 5]) as slots:  # every slot admitted again, the used ones zeroed
        assert slot in slots and state.delta.abs().max() == 0 and state.delta_conv.abs().max() == 0


@pytest.mark.parametrize("arch", ["gla+attn", "gdn+attn"])
def test_the_prefix_cache_stores_kv_up_to_the_junction_only(arch):
    m = hybrid(**ARCHS[arch])
    eng = engine(m, prefix_cache_bytes=1 << 22)
    prompt = list(range(1, 30))
    with eng.cache.leased([0]) as (slot,):
        eng.runner.prefill_cached(slot, prompt)
    (entry,) = eng.cache.prefix_cache._entries.values()
    assert entry.state.keys.shape[2] == len(prompt)  # positions written, not max_context
    logits = 0 if entry.logits is None else entry.logits.numel() * entry.logits.element_size()
    assert entry.nbytes == entry.state.nbytes + entry.state.kv_nbytes + logits
    assert entry.state.kv_nbytes == sequence_bytes(m.cfg, len(prompt))["kv_bytes"]
    assert entry.state.nbytes == analytic_state_bytes(m.cfg)  # the GDN layers' state and conv cache too


def serves_without_compiling(eng, eager) -> None:
    """A warmed engine replays staggered requests with recompiles failing, compiles nothing, and
    gives the greedy tokens of `eager` (the same weights) run as a full forward."""
    reqs = requests(seed=1, n=6)
    with torch.compiler.set_stance("fail_on_recompile"):
        done = replay(eng, reqs)
    assert not any(s.compiled for s in eng.scheduler.steps)
    for req, c in zip(reqs, done):
        assert c.output_ids == full_forward_greedy(eager, req.prompt_ids, req.max_new_tokens)[0], req.id


def test_a_compiled_hybrid_engine_never_compiles_while_serving():
    """Warmed at the limit the engine sets itself (from Dynamo's default): a hybrid's GLA and
    attention blocks share one forward, so each of its 5 shapes is 2 graphs, 10 > the floor of 8
    (`make compare`'s hybrid arm hit it at the default 4 widths and 2 buckets). Dynamo's eager
    backend, as below: the limit and the guards are Dynamo's; Inductor serves a compiled hybrid in
    tests/test_probes.py."""
    torch._dynamo.reset()
    m = hybrid()
    eng = engine(m, buckets=(16, 32), compile_scope="block", backend="eager")
    assert eng.runner.graphs_needed() == 2 * (3 + 2)
    with torch._dynamo.config.patch(recompile_limit=8, accumulated_recompile_limit=64):
        configure_compiler(eng.runner.graphs_needed())
        seconds = eng.runner.warmup()
    assert set(seconds["decode"]) == {1, 2, 4} and set(seconds["prefill"]) == {16, 32}
    serves_without_compiling(eng, hybrid())


def test_a_gla_gdn_attention_engine_compiles_each_kind_of_block_at_warmup_and_nothing_while_serving():
    """Every kind of block at once (GDN, attention, GLA): 3 graphs per shape under compile_scope
    "block", which the recompile limit must allow (it counted GDN as GLA: 10 of 15, and the warmup
    failed at the limit). Dynamo's eager backend: the tracing, guards and recompile limit Inductor
    has, without its code generation (minutes here; tests/test_numerics.py runs Inductor on GDN)."""
    # the block code objects' earlier entries (this module's other compiled tests) count toward the limit
    torch._dynamo.reset()
    spec = {"attn": ATTN, "gdn": {"layers": [0], **GDN_SPEC}}
    eng = engine(hybrid(**spec), compile_scope="block", backend="eager")
    assert eng.runner.graphs_needed() == 3 * (3 + 2)
    with torch._dynamo.config.patch(recompile_limit=8, accumulated_recompile_limit=64):
        configure_compiler(eng.runner.graphs_needed())
        seconds = eng.runner.warmup()
        assert set(seconds["decode"]) == {1, 2, 4} and set(seconds["prefill"]) == {8, 16}
        serves_without_compiling(eng, hybrid(**spec))


@pytest.mark.parametrize("arch", ["gla+attn", "gdn+attn"])
def test_the_numerics_checks_decode_paths_run_unchanged_on_a_hybrid(arch):
    """evals/numerics.py's teacher-forced decode at ladder widths with pad rows (NaN-free) equals
    the fp32 full forward, and its fp64 reference of the same weights agrees with both."""
    from laplace.evals.numerics import decode_logits, prefill_logits

    m = hybrid(**ARCHS[arch])
    tokens = torch.randint(0, VOCAB, (3, 20), generator=torch.Generator().manual_seed(3))
    want = m(tokens)[:, 12:19].transpose(0, 1).reshape(-1, VOCAB)  # position-major, as decode_logits
    for width in (2, 4):  # 2 live rows: width 2 exact, width 4 with two pad rows on the dummy slot
        got = decode_logits(engine(m), tokens[:, :12], tokens[:, 12:19], width, real=2)
        ref = want.view(7, 3, VOCAB)[:, :2].reshape(-1, VOCAB)
        assert (got - ref).abs().max() < 1e-4 * ref.abs().max(), width
    fp64 = hybrid(**ARCHS[arch]).double()
    assert (prefill_logits(fp64, tokens).float() - prefill_logits(m, tokens)).abs().max() < 1e-4
