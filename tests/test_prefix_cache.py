"""The state prefix cache (laplace/serving/prefix_cache.py, used by ModelRunner.prefill_cached):
greedy and seeded outputs with the cache equal those without it token for token, hits / misses /
bytes / evictions are counted exactly, a shared system prompt is cached where prompts diverge.
The equality tests run on a Gated DeltaNet model too (its state cached at any token, as GLA's)."""

import dataclasses

import numpy as np
import pytest
import torch

from laplace.config import EngineSection, ServeCheckSection
from laplace.model.config import preset_model_config
from laplace.model.lm import LaplaceLM, State
from laplace.serving.engine import DecodeEngine
from laplace.serving.prefix_cache import PrefixCache, common_prefix
from laplace.serving.replay import prefix_cache_comparison, replay
from laplace.serving.scheduler import Request
from laplace.serving.shapes import prefill_pieces
from laplace.serving.workload import SHARED_PREFIX, build_requests

VOCAB = 97


# a Gated DeltaNet model of the same shape (model.gdn: every layer GDN, GVA): the cache holds its state alike
GDN = {"layers": [0, 1], "num_heads": 1, "num_v_heads": 2, "head_dim": 16, "expand_v": 1.5}


def model(seed=0, gdn=None):
    torch.manual_seed(seed)
    cfg = preset_model_config(
        "tiny",
        vocab_size=VOCAB,
        d_model=32,
        n_layers=2,
        n_heads=2,
        chunk_size=16,
        sub_chunk_size=8,
        init_std=0.3,
        gdn=gdn,
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


@pytest.mark.parametrize("temperature,gdn", [(0.0, None), (1.0, None), (0.0, GDN)], ids=["0.0", "1.0", "gdn-0.0"])
def test_outputs_with_the_cache_equal_those_without_and_hits_are_counted(temperature, gdn):
    m = model(gdn=gdn)
    requests = shared_system_prompt(temperature=temperature)
    plain = replay(engine(m, 0), requests)
    cached_engine = engine(m, 1 << 20)
    cached = replay(cached_engine, requests)
    assert [c.output_ids for c in cached] == [c.output_ids for c in plain]  # token for token
    assert all(c.status == "done" for c in cached)

    stats = cached_engine.cache.stats()
    row = cached_engine.cache.state.bytes_per_sequence
    n = len(requests)
    # request 0 misses (empty cache); request 1 misses but shares the 37-token system prompt with
    # request 0, so its prefill is split there and the system prompt's state stored; 2.. hit it
    assert (stats["hits"], stats["misses"], stats["evictions"]) == (n - 2, 2, 0)
    assert stats["hit_tokens"] == (n - 2) * 37
    assert stats["entries"] == n + 1 and stats["bytes"] == (n + 1) * (row + 4 * VOCAB)  # state + fp32 logits
    assert stats["query_tokens"] == sum(len(r.prompt_ids) for r in requests)
    # a hit prefills only the user text: fewer padded tokens than the whole prompt
    prefill = [s.width for s in cached_engine.scheduler.steps if s.kind == "prefill"]
    assert prefill[2] < cached_engine.runner.padded_tokens(len(requests[2].prompt_ids))


@pytest.mark.parametrize("gdn", [None, GDN], ids=["gla", "gdn"])
def test_first_token_logits_equal_a_whole_prefill_within_rounding(gdn):
    """The state after a cached prefix and the rest equals one prefill of the whole prompt up to
    float rounding (the chunked form splits at other positions), far below any greedy margin."""
    m = model(gdn=gdn)
    requests = shared_system_prompt(n=4)
    eng = engine(m, 1 << 20)
    for r in requests:
        with eng.cache.leased([r.id]) as (slot,):
            cached, _ = eng.runner.prefill_cached(slot, r.prompt_ids)
        with eng.cache.leased([r.id]) as (slot,):
            whole = eng.runner.prefill(slot, r.prompt_ids)
        torch.testing.assert_close(cached, whole, rtol=1e-5, atol=1e-5)
    assert eng.cache.stats()["hits"] == 2


@pytest.mark.parametrize("gdn", [None, GDN], ids=["gla", "gdn"])
def test_a_conversation_continues_from_its_whole_previous_prompt(gdn):
    m = model(gdn=gdn)
    eng = engine(m, 1 << 20)
    rng = np.random.default_rng(3)
    turn1 = rng.integers(0, VOCAB, 20).tolist()
    (done1,) = eng.complete([Request(0, turn1, 5)])
    turn2 = turn1 + done1.output_ids + rng.integers(0, VOCAB, 6).tolist()
    (done2,) = eng.complete([Request(1, turn2, 5)])
    stats = eng.cache.stats()
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
    plan = cache.plan(np.concatenate([keys[0], [99]]))  # uses keys[0]: now most recent
    assert plan.start == 3 and float(plan.state.recurrent[0, 0, 0]) == 0.0
    cache.put(keys[3], row(3))  # over budget: the least recently used (keys[1]) goes
    assert cache.stats() == {
        "hits": 1,
        "misses": 0,
        "bytes": 3 * nbytes,
        "kv_bytes": 0,  # GLA rows: no attention K/V
        "evictions": 1,
        "entries": 3,
        "hit_tokens": 3,
        "query_tokens": 4,
    }
    assert cache.plan(np.concatenate([keys[1], [99]])).state is None  # evicted: a miss
    assert cache.plan(np.concatenate([keys[2], [99]])).start == 3
    PrefixCache(budget_bytes=nbytes - 1).put(keys[0], row(0))  # larger than the budget: not stored, no error
    off = PrefixCache(0)
    off.put(keys[0], row(0))
    assert len(off) == 0 and not off.enabled


def test_an_exact_repeat_prefills_nothing_and_a_split_is_made_only_where_it_saves_a_bucket():
    cache = PrefixCache(budget_bytes=1 << 20, min_tokens=4)
    s, logits = State(torch.zeros(1, 1, 2), None), torch.zeros(1, 5)
    cache.put(np.arange(10), s, logits)
    # the same prompt again: its state and last logits are cached, nothing is prefilled (the old plan
    # split it one token short: two prefill pieces where no cache needs one)
    plan = cache.plan(np.arange(10))
    assert (plan.start, plan.split) == (10, None) and plan.logits is logits

    # shares 6 tokens: split there when the remainder fits a smaller bucket than the whole prompt
    def buckets(sizes):
        return lambda n: sum(b for _, b in prefill_pieces(n, sizes))

    prompt = np.r_[np.arange(6), 50, 51]
    assert cache.plan(prompt, buckets([2, 8])).split == 6  # 2 tokens left: bucket 2 instead of 8
    assert cache.plan(prompt, buckets([8])).split is None  # bucket 8 either way: no split, no second piece
    assert cache.plan(np.r_[0, 1, 50, 51, 52]).split is None  # shares 2 (< min_tokens)
    assert common_prefix(np.arange(5), np.arange(3)) == 3 and common_prefix(np.array([1]), np.array([2])) == 0


def test_an_exact_repeat_is_never_slower_than_no_cache_in_prefill_tokens():
    """The issue's case: a prompt under the largest bucket, seen twice. Without the cache each sighting
    prefills one bucket; with it the first does the same and the repeat prefills nothing; a long prompt's
    remainder after a cached prefix runs at the smallest bucket that holds it; outputs are identical."""
    m = model()
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, VOCAB, 57).tolist()  # like 228 tokens under a 256 bucket
    off, on = engine(m, 0, buckets=(16, 64)), engine(m, 1 << 20, buckets=(16, 64))
    outs = {}
    for name, eng in (("off", off), ("on", on)):
        outs[name] = [eng.complete([Request(i, prompt, 4)])[0].output_ids for i in range(2)]
    prefill = {
        name: [s.width for s in e.scheduler.steps if s.kind == "prefill"] for name, e in (("off", off), ("on", on))
    }
    assert prefill["off"] == [64, 64] and prefill["on"] == [64, 0]
    assert outs["on"] == outs["off"]
    # a long shared prefix: the remainder runs at the smallest bucket that holds it
    long_prefix = rng.integers(0, VOCAB, 150).tolist()
    first, second = long_prefix + [1, 2, 3], long_prefix + [4, 5, 6, 7, 8]
    on.complete([Request(10, first, 2)])
    on.complete([Request(11, second, 2)])  # shares 150 with the first: split there (5 left: bucket 16)
    on.scheduler.steps.clear()
    third = long_prefix + [9] * 10
    (done,) = on.complete([Request(12, third, 3)])
    assert [s.width for s in on.scheduler.steps if s.kind == "prefill"] == [16]  # 10 tokens after the cached 150
    (alone,) = engine(m, 0, buckets=(16, 64)).complete([Request(12, third, 3)])
    assert done.output_ids == alone.output_ids
    stats = on.cache.stats()
    assert stats["hit_tokens"] == 57 + 150 and stats["query_tokens"] == 2 * 57 + 153 + 155 + 160
    # vLLM's prefix-cache counters (in tokens, as vLLM counts them) are exported from these
    from prometheus_client.parser import text_string_to_metric_families

    from laplace.serving.metrics import ServerMetrics

    metrics = ServerMetrics(2, "m")
    metrics.prefix_cache.snapshot = stats
    families = {f.name: f for f in text_string_to_metric_families(metrics.exposition()[0].decode())}
    assert families["vllm:prefix_cache_queries"].samples[0].value == stats["query_tokens"]
    assert families["vllm:prefix_cache_hits"].samples[0].value == stats["hit_tokens"]
    assert families["vllm:prefix_cache_hits"].samples[0].labels == {"model_name": "m"}


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
    assert eng.cache.prefix_cache.budget_bytes == 1 << 20 and len(eng.cache.prefix_cache) == 0  # restored, cleared
