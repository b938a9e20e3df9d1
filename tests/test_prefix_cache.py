"""The state prefix cache (laplace/serving/prefix_cache.py, used by DecodeEngine.prefill_cached):
greedy and seeded outputs with the cache equal those without it token for token, hits / misses /
bytes / evictions are counted exactly, a shared system prompt is cached where prompts diverge."""

import dataclasses

import numpy as np
import pytest
import torch

from laplace.config import EngineSection, ServeCheckSection
from laplace.model.config import preset_model_config
from laplace.model.lm import LaplaceLM, State
from laplace.serving.engine import DecodeEngine, Request
from laplace.serving.prefix_cache import PrefixCache, common_prefix
from laplace.serving.replay import prefix_cache_comparison, replay
from laplace.serving.workload import SHARED_PREFIX, build_requests

VOCAB = 97


def model(seed=0):
    torch.manual_seed(seed)
    cfg = preset_model_config(
        "tiny", vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2, chunk_size=16, sub_chunk_size=8, init_std=0.3
    )  # wide logits: no near-ties for greedy
    return LaplaceLM(cfg).eval()


def engine(m, cache_bytes, buckets=(16, 32), max_slots=2, min_tokens=4):
    shapes = dict(max_slots=max_slots, prefill_buckets=list(buckets), max_prompt_tokens=256)
    cache = dict(prefix_cache_bytes=cache_bytes, prefix_cache_min_tokens=min_tokens)
    return DecodeEngine(m, dataclasses.replace(EngineSection(), widths=[], **shapes, **cache), "padded", compiled=False)


def shared_system_prompt(n=6, system_len=37, seed=0, temperature=0.0):
    """n prompts: one system prompt, then user text whose first tokens all differ."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, VOCAB, system_len).tolist()
    firsts = rng.permutation(VOCAB)[:n]
    return [
        Request(
            i,
            system + [int(firsts[i])] + rng.integers(0, VOCAB, int(rng.integers(3, 40))).tolist(),
            int(rng.integers(4, 12)),
            temperature=temperature,
            top_p=0.9,
            seed=i,
            arrival_s=0.001 * i,
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_with_the_cache_equal_those_without_and_hits_are_counted(temperature):
    m = model()
    requests = shared_system_prompt(temperature=temperature)
    plain = replay(engine(m, 0), requests)
    cached_engine = engine(m, 1 << 20)
    cached = replay(cached_engine, requests)
    assert [c.output_ids for c in cached] == [c.output_ids for c in plain]  # token for token
    assert all(c.status == "done" for c in cached)

    stats = cached_engine.prefix_cache_stats()
    row = cached_engine.state.bytes_per_sequence
    n = len(requests)
    # request 0 misses (empty cache); request 1 misses but shares the 37-token system prompt with
    # request 0, so its prefill is split there and the system prompt's state stored; 2.. hit it
    assert (stats["hits"], stats["misses"], stats["evictions"]) == (n - 2, 2, 0)
    assert stats["hit_tokens"] == (n - 2) * 37
    assert stats["entries"] == n + 1 and stats["bytes"] == (n + 1) * row
    # a hit prefills only the user text: fewer padded tokens than the whole prompt
    prefill = [s.width for s in cached_engine.steps if s.kind == "prefill"]
    assert prefill[2] < cached_engine.padded_tokens(len(requests[2].prompt_ids))


def test_first_token_logits_equal_a_whole_prefill_within_rounding():
    """The state after a cached prefix and the rest equals one prefill of the whole prompt up to
    float rounding (the chunked form splits at other positions), far below any greedy margin."""
    m = model()
    requests = shared_system_prompt(n=4)
    eng = engine(m, 1 << 20)
    for r in requests:
        with eng.leased([r.id]) as (slot,):
            cached, _ = eng.prefill_cached(slot, r.prompt_ids)
        with eng.leased([r.id]) as (slot,):
            whole = eng.prefill(slot, r.prompt_ids)
        torch.testing.assert_close(cached, whole, rtol=1e-5, atol=1e-5)
    assert eng.prefix_cache_stats()["hits"] == 2


def test_a_conversation_continues_from_its_whole_previous_prompt():
    m = model()
    eng = engine(m, 1 << 20)
    rng = np.random.default_rng(3)
    turn1 = rng.integers(0, VOCAB, 20).tolist()
    (done1,) = eng.complete([Request(0, turn1, 5)])
    turn2 = turn1 + done1.output_ids + rng.integers(0, VOCAB, 6).tolist()
    (done2,) = eng.complete([Request(1, turn2, 5)])
    stats = eng.prefix_cache_stats()
    assert (stats["hits"], stats["misses"], stats["hit_tokens"]) == (1, 1, 20)
    (alone,) = engine(m, 0).complete([Request(1, turn2, 5)])
    assert done2.output_ids == alone.output_ids


def test_lru_eviction_within_the_byte_budget():
    def row(v):
        return State(torch.full((1, 1, 4), float(v)), torch.full((1, 1, 2, 3), float(v)))

    nbytes = row(0).nbytes  # 4*4 + 6*4 = 40
    cache = PrefixCache(budget_bytes=3 * nbytes)
    keys = [np.array([k, k + 1, k + 2]) for k in range(0, 40, 10)]
    for i, k in enumerate(keys[:3]):
        cache.put(k, row(i))
    start, state, _ = cache.plan(np.concatenate([keys[0], [99]]))  # uses keys[0]: now most recent
    assert start == 3 and float(state.recurrent[0, 0, 0]) == 0.0
    cache.put(keys[3], row(3))  # over budget: the least recently used (keys[1]) goes
    assert cache.stats() == {
        "hits": 1,
        "misses": 0,
        "bytes": 3 * nbytes,
        "kv_bytes": 0,  # GLA rows: no attention K/V
        "evictions": 1,
        "entries": 3,
        "hit_tokens": 3,
    }
    assert cache.plan(np.concatenate([keys[1], [99]]))[1] is None  # evicted: a miss
    assert cache.plan(np.concatenate([keys[2], [99]]))[0] == 3
    PrefixCache(budget_bytes=nbytes - 1).put(keys[0], row(0))  # larger than the budget: not stored, no error
    off = PrefixCache(0)
    off.put(keys[0], row(0))
    assert len(off) == 0 and not off.enabled


def test_split_points_and_the_last_token_is_always_prefilled():
    cache = PrefixCache(budget_bytes=1 << 20, min_tokens=4)
    s = State(torch.zeros(1, 1, 2), None)
    cache.put(np.arange(10), s)
    # the same prompt again: the whole entry cannot be used (its last token's logits are needed),
    # so the prefill is split one token short and that prefix stored
    assert cache.plan(np.arange(10)) == (0, None, 9)
    # shares 6 tokens: split there; shares 2 (< min_tokens): no split
    assert cache.plan(np.r_[np.arange(6), 50, 51])[2] == 6
    assert cache.plan(np.r_[0, 1, 50, 51, 52])[2] is None
    assert common_prefix(np.arange(5), np.arange(3)) == 3 and common_prefix(np.array([1]), np.array([2])) == 0


def test_the_shared_prefix_workload_and_the_replay_side_by_side():
    serve = dataclasses.replace(
        ServeCheckSection(), requests=8, prompt_tokens=[4, 30], output_tokens=[2, 6], shared_prefix_tokens=40
    )
    text = np.random.default_rng(0).integers(0, VOCAB, 5000)
    reqs = build_requests(SHARED_PREFIX, serve, text, seed=1, max_prompt_tokens=EngineSection.max_prompt_tokens)
    assert reqs == build_requests(SHARED_PREFIX, serve, text, 1, EngineSection.max_prompt_tokens)  # seeded
    system = reqs[0].prompt_ids[:40]
    assert all(r.prompt_ids[:40] == system and 44 <= len(r.prompt_ids) <= 70 for r in reqs)
    assert len({tuple(r.prompt_ids[40:]) for r in reqs}) == len(reqs)
    with pytest.raises(ValueError, match="shared_prefix_tokens: 300 leaves no room"):
        build_requests(SHARED_PREFIX, dataclasses.replace(serve, shared_prefix_tokens=300), text, 1, 256)

    eng = engine(model(), 1 << 20, min_tokens=16)
    out = prefix_cache_comparison(eng, reqs, 1.0, 0.05)
    assert out["identical_outputs_share"] == 1.0
    assert out["off"]["prefix_cache"]["hits"] == 0 and out["on"]["prefix_cache"]["hits"] >= len(reqs) - 2
    assert out["on"]["prefill_tokens_computed"] < out["off"]["prefill_tokens_computed"]
    assert eng.prefix_cache.budget_bytes == 1 << 20 and len(eng.prefix_cache) == 0  # restored, cleared
