"""The decode engine: padded batching equals single-request generation and a naive full-forward
reference, pads are isolated, slots are accounted for, long prompts go in bucket pieces, bad
requests are rejected, cancelled or failed requests free their slots, and after warmup nothing
compiles while serving."""

import dataclasses
import math

import numpy as np
import pytest
import torch

from laplace.config import EngineSection, ServeCheckSection, width_ladder
from laplace.model.lm import LaplaceLM
from laplace.runtime import configure_compiler
from laplace.serving.engine import DecodeEngine
from laplace.serving.generation import generate_ids
from laplace.serving.model_runner import DecodeBatch
from laplace.serving.replay import decode_cost, long_prompt, replay, summarize
from laplace.serving.scheduler import Rejected, Request, StepRecord
from laplace.serving.shapes import fit, prefill_pieces
from laplace.serving.workload import arrival_times, build_requests

from project import tiny_model_config

VOCAB = 97


def model(seed=0):
    torch.manual_seed(seed)
    cfg = tiny_model_config(VOCAB, n_layers=2, init_std=0.3)  # wide logits: no near-ties for greedy
    return LaplaceLM(cfg).eval()


def engine(m, *, max_slots=4, widths=None, buckets=(16, 32), compile_scope=None, exact=False, max_prompt_tokens=None):
    shapes = dict(max_slots=max_slots, widths=list(widths or []), prefill_buckets=list(buckets))
    params = dataclasses.replace(
        EngineSection(),
        **shapes,
        max_prompt_tokens=max_prompt_tokens or max(buckets),
        compile_scope=compile_scope or "block",
    )
    params = dataclasses.replace(params, prefix_cache_bytes=0)
    return DecodeEngine(m, params, "exact" if exact else "padded", compiled=compile_scope is not None)


@torch.inference_mode()
def naive_greedy(m, prompt, n):
    """Greedy tokens by the full training forward over the growing sequence: no state, no engine."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(m(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt) :]


def staggered(n=11, seed=0):
    rng = np.random.default_rng(seed)
    return [
        Request(
            i,
            rng.integers(0, VOCAB, rng.integers(1, 30)).tolist(),
            int(rng.integers(1, 14)),
            arrival_s=float(i) * 0.002 * rng.integers(0, 3),
        )
        for i in range(n)
    ]


def test_ladders():
    assert width_ladder(8) == [1, 2, 4, 8]
    assert width_ladder(20) == [1, 2, 4, 8, 16, 20]
    assert width_ladder(20, [1, 2, 4, 8, 12, 16, 20]) == [1, 2, 4, 8, 12, 16, 20]
    assert [fit(n, [1, 2, 4, 8, 12, 16, 20]) for n in (1, 3, 9, 13, 20)] == [1, 4, 12, 16, 20]
    for refused in ([1, 2, 16], [1, 4, 32], [4, 2, 20], [0, 20]):  # short, too wide, unsorted, zero
        with pytest.raises(ValueError, match="engine.widths: must increase strictly from >= 1 to max_slots=20"):
            width_ladder(20, refused)


@pytest.mark.parametrize("widths", [None, [1, 3, 4]])
def test_engine_outputs_equal_each_request_alone(widths):
    m = model()
    eng = engine(m, max_slots=4, widths=widths)
    requests = staggered()
    done = replay(eng, requests)
    assert [c.status for c in done] == ["done"] * len(requests)
    decode_widths = {s.width for s in eng.scheduler.steps if s.kind == "decode"}
    assert decode_widths <= set(width_ladder(4, widths)) and len(decode_widths) > 1  # padded, mixed widths
    assert any(s.width > s.live for s in eng.scheduler.steps if s.kind == "decode")  # some steps carried pad rows
    for req, c in zip(requests, done):
        alone = generate_ids(m, req.prompt_ids, req.max_new_tokens, temperature=0.0)
        assert c.output_ids == alone == naive_greedy(m, req.prompt_ids, req.max_new_tokens), req.id


def test_prefill_pieces_and_long_prompts_through_the_bucket_graphs():
    assert prefill_pieces(5, [16, 32]) == [(5, 16)]
    assert prefill_pieces(32, [16, 32]) == [(32, 32)]
    assert prefill_pieces(77, [16, 32]) == [(32, 32), (32, 32), (13, 16)]
    m = model()
    eng = engine(m, buckets=(16, 32))
    shapes = []
    prefill_piece = eng.runner.prefill_piece
    eng.runner.prefill_piece = lambda t, s, n: shapes.append((tuple(t.shape), int(n))) or prefill_piece(t, s, n)
    prompt = torch.randint(0, VOCAB, (77,), generator=torch.Generator().manual_seed(1))
    with eng.cache.leased([7]) as (slot,):
        chunked = eng.runner.prefill(slot, prompt.tolist())
        state = m.allocate_state(1)
        with torch.inference_mode():
            whole = m.prefill(prompt.view(1, -1), state)
        torch.testing.assert_close(chunked, whole, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(eng.cache.state.recurrent[:, slot], state.recurrent[:, 0], rtol=1e-4, atol=1e-5)
    assert shapes == [((1, 32), 32), ((1, 32), 32), ((1, 16), 13)]  # only bucket shapes ran
    assert eng.cache.pool.owners == {}
    # the scheduler takes the same long prompts, so generation has no prompt-length limit of its own
    alone = generate_ids(m, prompt.tolist(), 5)
    assert alone == naive_greedy(m, prompt.tolist(), 5)


def test_a_long_prompt_is_prefilled_a_chunk_per_step_while_the_others_decode():
    """vLLM's chunked prefill: a prompt over the largest bucket takes one chunk (that bucket's
    tokens) per engine step, each followed by a decode step of the requests already streaming, so
    they keep producing tokens while it is prefilled; every output still equals the request alone."""
    m = model()
    eng = engine(m, max_slots=4, buckets=(16, 32), max_prompt_tokens=1000)
    rng = np.random.default_rng(3)
    streaming = [Request(i, rng.integers(0, VOCAB, 5).tolist(), 12) for i in range(2)]
    long = Request(2, rng.integers(0, VOCAB, 150).tolist(), 3)
    done = replay(eng, [*streaming, long])
    chunks = [s for s in eng.scheduler.steps if s.kind == "prefill"][2:]  # after the two short prompts'
    assert [c.width for c in chunks] == [32, 32, 32, 32, 32]  # 150 tokens: 4 x 32, then 22 in the 32 bucket
    kinds = [s.kind for s in eng.scheduler.steps[2:12]]
    assert kinds == ["prefill", "decode"] * 5  # each chunk followed by a decode step of the others
    first_long = done[2].token_times[0]
    for c in done[:2]:  # tokens streamed while the long prompt was prefilled: one per chunk but the last
        assert sum(t < first_long for t in c.token_times) == 1 + 4
    for req, c in zip([*streaming, long], done):
        assert c.status == "done" and c.output_ids == generate_ids(m, req.prompt_ids, req.max_new_tokens), req.id

    # two long prompts waiting share one chunk of tokens per step (the first one's last piece may
    # leave room for a piece of the next): the streams' decode gaps stay about one chunk
    eng.reset()
    other = Request(3, long.prompt_ids[::-1], 3)
    done = replay(eng, [*streaming, long, other])
    between, gaps = 0, []
    for step in eng.scheduler.steps[4:]:  # after the step that admitted them all (a chunk each)
        if step.kind == "decode":
            gaps.append(between)
            between = 0
        else:
            between += step.width
    assert max(gaps) <= 2 * 32 and sum(gaps) == 2 * 5 * 32 - 2 * 32  # 5 chunks each, one at admission
    for req, c in zip([*streaming, long, other], done):
        assert c.output_ids == generate_ids(m, req.prompt_ids, req.max_new_tokens), req.id

    # cancelled between chunks: its prefill stops there, its slot serves the next request
    eng.reset()
    for req in [*streaming, long]:
        eng.scheduler.submit(req)
    eng.step()
    assert eng.scheduler.cancel(long.id).status == "cancelled" and eng.cache.free_slots == 2
    after = Request(3, streaming[0].prompt_ids, 4)
    eng.scheduler.submit(after)
    while eng.scheduler.has_work():
        eng.step()
    finished = {c.request_id: c for c in eng.scheduler.take_finished()}
    assert finished[3].output_ids == generate_ids(m, after.prompt_ids, 4) and eng.cache.pool.owners == {}

    # serve-check's figures of the same: the long prompt's TTFT, the streams' gaps with and without it
    figures = long_prompt(eng, 150, np.asarray(long.prompt_ids))
    assert figures["prompt_tokens"] == 150 and figures["chunk_tokens"] == 32 and figures["compile_events"] == 0
    assert figures["ttft_s"] > 0 and figures["streams_itl_max_s_with"] > 0 and figures["streams_itl_max_s_without"] > 0


@pytest.mark.parametrize("attn", [None, {"layers": [1], "num_heads": 2}], ids=["gla", "hybrid"])
def test_an_echo_prompt_gets_its_log_probs_a_chunk_per_step_while_the_others_decode(attn):
    """echo + logprobs (lm-eval's local-completions): the prompt's log-probs are computed as it is
    prefilled, a chunk (the largest bucket's tokens, run eagerly for every position's logits) per
    engine step, each followed by a decode step of the requests streaming; they equal the model's
    parallel forward over the whole prompt, and the generation after them is the request's alone.
    A hybrid carries its K/V from chunk to chunk. No cached prefix serves an echo (it needs every
    position's logits); it stores its whole prompt for the requests after it."""
    torch.manual_seed(0)
    m = LaplaceLM(tiny_model_config(VOCAB, n_layers=2, init_std=0.3, attn=attn)).eval()
    shapes = dict(max_slots=4, widths=[], prefill_buckets=[16, 32], max_prompt_tokens=1000, max_context=200)
    eng = DecodeEngine(m, dataclasses.replace(EngineSection(), **shapes), "padded", compiled=False)
    rng = np.random.default_rng(3)
    streaming = [Request(i, rng.integers(0, VOCAB, 5).tolist(), 12) for i in range(2)]
    echo = Request(2, rng.integers(0, VOCAB, 150).tolist(), 3, logprobs=2, prompt_logprobs=2)
    done = replay(eng, [*streaming, echo])
    chunks = [s for s in eng.scheduler.steps if s.kind == "prefill"][2:]  # after the two short prompts'
    assert [c.width for c in chunks] == [32, 32, 32, 32, 22]  # 150 tokens, unpadded (eager)
    assert [s.kind for s in eng.scheduler.steps[2:12]] == ["prefill", "decode"] * 5
    first_echo = done[2].token_times[0]
    for c in done[:2]:  # tokens streamed while the echo was prefilled: one per chunk but the last
        assert sum(t < first_echo for t in c.token_times) == 1 + 4
    assert all(c.status == "done" for c in done) and done[0].prompt_logprobs is None and len(done[2].logprobs) == 3
    assert done[2].output_ids == generate_ids(m, echo.prompt_ids, 3)  # its state in its slot, as a plain prefill's

    lp = done[2].prompt_logprobs
    assert len(lp) == 150 and lp[0] is None
    with torch.inference_mode():
        ref = torch.log_softmax(m(torch.tensor([echo.prompt_ids]))[0, :-1], -1)  # fp32, as the engine's
    targets = torch.tensor(echo.prompt_ids[1:])
    chosen = torch.tensor([e[0] for e in lp[1:]])
    # fp32, the forward split at chunk boundaries (summation order only): log-probs of up to ~13 nats
    # here, whose ulp is 1e-6, differ by a few ulps (3.8e-6 at most, GLA, when written): within
    # assert_close's fp32 defaults (1e-5 + 1.3e-6 |x|)
    torch.testing.assert_close(chosen, ref[torch.arange(149), targets])
    top = ref.topk(2)
    torch.testing.assert_close(torch.tensor([[v for _, v in e[1]] for e in lp[1:]]), top.values)
    assert [[t for t, _ in e[1]] for e in lp[1:]] == top.indices.tolist()

    # the same echo again: computed again (no cached prefix has per-position logits), equal; the
    # whole prompt it stored serves a plain request of it (an exact repeat: nothing to prefill)
    hits = eng.cache.stats()["hits"]
    again = dataclasses.replace(echo, id=3)
    plain = dataclasses.replace(echo, id=4, logprobs=None, prompt_logprobs=None)
    assert replay(eng, [again])[-1].prompt_logprobs == lp and eng.cache.stats()["hits"] == hits
    assert replay(eng, [plain])[-1].output_ids == done[2].output_ids and eng.cache.stats()["hits"] == hits + 1


def test_decode_cost_times_every_context_with_one_slot_or_several():
    """serve-check's decode-cost check leases a slot per context and alternates between them; an
    engine of one slot (engine.max_slots: 1) times the contexts in turn, with every slot freed."""
    text = list(range(1, VOCAB))
    for max_slots in (1, 4):
        eng = engine(model(), max_slots=max_slots, buckets=(16, 32))
        cost = decode_cost(eng, [40, 100, 70], steps=3, text=text)
        assert set(cost["decode_s_per_token"]) == {"40", "100", "70"}, max_slots
        assert all(t > 0 for t in cost["decode_s_per_token"].values())
        assert cost["ratio"] == cost["decode_s_per_token"]["100"] / cost["decode_s_per_token"]["40"]
        assert len(set(cost["state_bytes_per_sequence"].values())) == 1
        assert eng.cache.pool.owners == {}


def test_decode_pads_to_the_ladder_on_the_dummy_slot_and_equals_the_unpadded_rows():
    m = model()
    eng = engine(m, max_slots=4)  # ladder 1, 2, 4
    seen = []
    decode_step = eng.runner.decode_step
    eng.runner.decode_step = lambda batch: seen.append(batch.ints[1].tolist()) or decode_step(batch)
    with eng.cache.leased([0, 1, 2]) as slots:
        for slot, prompt in zip(slots, ([1, 2, 3], [4, 5], [6])):
            eng.runner.prefill(slot, prompt)
        before = eng.cache.state.clone()
        padded = eng.runner.decode_rows(slots, [7, 8, 9])  # 3 rows -> width 4, one pad row
        assert seen[-1] == slots + [eng.cache.pool.dummy]
        assert padded.shape == (3, VOCAB)
        with pytest.raises(ValueError, match="cannot decode 3 rows at width 3"):
            eng.runner.decode_rows(slots, [7, 8, 9], width=3)  # not a ladder width
        exact = engine(m, max_slots=4, exact=True)  # the same rows at width 3, no padding
        exact.cache.state.recurrent.copy_(before.recurrent)
        exact.cache.state.conv.copy_(before.conv)
        torch.testing.assert_close(exact.runner.decode_rows(slots, [7, 8, 9]), padded, rtol=1e-5, atol=1e-5)
        rows = torch.tensor(slots)
        torch.testing.assert_close(exact.cache.state.recurrent[:, rows], eng.cache.state.recurrent[:, rows])


def test_cancel_and_failed_steps_free_their_slots_and_the_engine_serves_on():
    m = model()
    eng = engine(m, max_slots=2)
    for i in range(3):
        eng.scheduler.submit(Request(i, [1, 2, 3], 50))
    eng.step()  # two admitted and decoding, one waiting
    assert eng.cache.pool.busy == 2 and len(eng.scheduler.queue) == 1
    waiting = eng.scheduler.cancel(2, "client went away")
    assert waiting.status == "cancelled" and waiting.output_ids == [] and not eng.scheduler.queue
    live = eng.scheduler.cancel(0)
    assert live.status == "cancelled" and len(live.output_ids) == 2 and eng.cache.pool.busy == 1
    assert eng.scheduler.cancel(0) is None  # gone already

    def broken(*args):
        raise RuntimeError("Detected recompile when torch.compile stance is 'fail_on_recompile'\nmore")

    eng.runner.decode_step = broken
    with pytest.raises(RuntimeError, match="fail_on_recompile"):
        eng.step()
    failed = [c for c in eng.scheduler.take_finished() if c.status == "failed"]
    assert [c.request_id for c in failed] == [1] and eng.cache.pool.busy == 0 and not eng.scheduler.live
    assert failed[0].reason == (
        "decode step at width 1: RuntimeError: Detected recompile when torch.compile stance is 'fail_on_recompile'"
    )
    del eng.runner.decode_step  # the class's again: the next request is served as usual
    (done,) = eng.complete([Request(9, [4, 5], 3)])
    assert done.status == "done" and done.output_ids == naive_greedy(m, [4, 5], 3)


def test_generation_through_the_engine_rejects_bad_requests_with_the_reason():
    m = model()
    with pytest.raises(Rejected, match="^empty prompt$"):
        generate_ids(m, [], 3)
    with pytest.raises(Rejected, match="max_new_tokens must be > 0"):
        generate_ids(m, [1], 0)
    sampled = generate_ids(m, [1, 2], 12, temperature=1.0, top_p=0.9, seed=3)
    assert sampled == generate_ids(m, [1, 2], 12, temperature=1.0, top_p=0.9, seed=3)
    assert sampled != generate_ids(m, [1, 2], 12, temperature=1.0, top_p=0.9, seed=4)


def test_pad_rows_only_touch_the_dummy_slot_even_as_nan():
    m = model()
    clean, poisoned = engine(m), engine(m)
    tokens = torch.tensor([5, 7, 0, 0])
    for eng in (clean, poisoned):
        for slot, prompt in ((0, [1, 2, 3]), (2, [4, 5])):
            eng.runner.prefill_piece(
                torch.tensor([prompt + [0] * (16 - len(prompt))]), torch.tensor([slot]), torch.tensor([len(prompt)])
            )
    poisoned.cache.state.recurrent[:, poisoned.cache.pool.dummy] = float("nan")
    poisoned.cache.state.conv[:, poisoned.cache.pool.dummy] = float("nan")
    slots = torch.tensor([0, 2, 4, 4])  # two real rows, two pad rows on the dummy slot (index 4, never -1)
    with torch.inference_mode():
        a = clean.runner.decode_step(DecodeBatch.greedy(tokens, slots))[1]
        b = poisoned.runner.decode_step(DecodeBatch.greedy(tokens, slots))[1]
    assert torch.isfinite(b[:2]).all() and torch.equal(a[:2], b[:2])
    for rows in ([0, 2], [1, 3]):
        idx = torch.tensor(rows)
        assert torch.equal(clean.cache.state.recurrent[:, idx], poisoned.cache.state.recurrent[:, idx])
    assert torch.isnan(poisoned.cache.state.recurrent[:, 4]).all()


def test_slots_are_reused_rezeroed_and_never_shared():
    m = model()
    eng = engine(m, max_slots=2)
    requests = staggered(n=7)
    owners_seen = []
    original_step = eng.step

    def checked_step():
        original_step()
        live_slots = [r.slot for r in eng.scheduler.live]
        assert len(live_slots) == len(set(live_slots)), "two live requests share a slot"
        assert eng.cache.pool.dummy not in live_slots
        owners_seen.append(eng.cache.pool.owners)

    eng.step = checked_step
    done = replay(eng, requests)
    assert all(c.status == "done" for c in done)
    slot_users = {}
    for owners in owners_seen:
        for slot, rid in owners.items():
            slot_users.setdefault(slot, set()).add(rid)
    assert all(len(users) > 1 for users in slot_users.values())  # every slot served several requests
    assert eng.cache.pool.free == 2 and eng.cache.pool.owners == {}
    # a reused slot starts from zero: a prefill into a dirty slot leaves exactly the state (and
    # produces exactly the token) of a prefill into a clean one
    dirty, fresh = engine(m), engine(m)
    dirty.cache.state.recurrent.fill_(3.0)
    dirty.cache.state.conv.fill_(3.0)
    for eng_ in (dirty, fresh):
        eng_.scheduler.submit(Request(0, [1, 2, 3, 4], 1))
        eng_.step()
    assert dirty.scheduler.finished[0].output_ids == fresh.scheduler.finished[0].output_ids
    assert torch.equal(dirty.cache.state.recurrent[:, 0], fresh.cache.state.recurrent[:, 0])
    assert torch.equal(dirty.cache.state.conv[:, 0], fresh.cache.state.conv[:, 0])


def test_bad_requests_are_rejected_while_others_are_served():
    m = model()
    eng = engine(m, buckets=(16, 32))
    good = staggered(n=4)
    bad = [
        Request(100, [], 5),
        Request(101, [1] * 33, 5),
        Request(102, [1, 2], 0),
        Request(103, [VOCAB + 5], 3),
        Request(104, [1, 2], 3, temperature=-1.0),
    ]
    done = {c.request_id: c for c in replay(eng, good + bad)}
    assert all(done[r.id].status == "done" and len(done[r.id].output_ids) == r.max_new_tokens for r in good)
    reasons = {rid: done[rid].reason for rid in range(100, 105)}
    assert all(done[rid].status == "rejected" for rid in reasons)
    assert reasons[100] == "empty prompt"
    assert reasons[101] == "prompt has 33 tokens, the limit is 32 (engine.max_prompt_tokens)"
    assert reasons[102] == "max_new_tokens must be > 0, got 0"
    assert "outside the vocabulary" in reasons[103]
    assert "temperature must be >= 0" in reasons[104]


def test_summarize_counts_compile_stalls_and_padding():
    steps = [
        StepRecord("prefill", 0, 0.5, 16, 1, True),
        StepRecord("decode", 0.5, 9.0, 2, 2, True),
        StepRecord("decode", 9.5, 0.01, 4, 3, False),
        StepRecord("decode", 9.51, 0.01, 4, 3, False),
        StepRecord("decode", 9.52, 0.02, 2, 1, False),
    ]
    from laplace.serving.scheduler import Completion

    done = [Completion(0, "done", output_ids=[1, 2, 3], arrival_s=0.0, token_times=[0.5, 9.5, 9.51], finished_s=9.51)]
    m = summarize(steps, done, ttft_slo=1.0, tpot_slo=0.1)
    assert m["compile_events"] == 2 and m["compile_events_decode"] == 1
    assert m["compile_step_share"] == pytest.approx(1 / 4)
    assert m["compile_time_share"] == pytest.approx(9.0 / 9.04)
    assert m["padding_waste"] == pytest.approx((0 + 1 + 1 + 1) / (2 + 4 + 4 + 2))
    assert m["compile_cost_step_equivalents"] == pytest.approx(9.5 / 0.01)
    assert m["widths_visited"] == 2 and m["widths_histogram"] == {"2": 2, "4": 2}
    assert m["ttft_p50_s"] == pytest.approx(0.5) and m["tpot_p50_s"] == pytest.approx(4.505)
    assert m["goodput_fraction"] == 0.0  # tpot 4.5 s misses the 0.1 s SLO


def test_arrival_processes():
    rng = np.random.default_rng(0)
    assert (arrival_times("batch", 5, 10, 3, rng) == 0).all()
    gaps = np.diff(arrival_times("poisson", 20001, 10.0, 3.0, rng))
    assert gaps.mean() == pytest.approx(0.1, rel=0.05) and gaps.std() / gaps.mean() == pytest.approx(1, rel=0.05)
    gaps = np.diff(arrival_times("bursty", 20001, 10.0, 3.0, rng))
    assert gaps.mean() == pytest.approx(0.1, rel=0.1) and gaps.std() / gaps.mean() == pytest.approx(3, rel=0.1)
    serve = ServeCheckSection(requests=30, prompt_tokens=[4, 20], output_tokens=[2, 9])
    reqs = build_requests("poisson", serve, np.arange(1000) % VOCAB, seed=1)
    assert reqs == build_requests("poisson", serve, np.arange(1000) % VOCAB, seed=1)  # seeded
    assert all(4 <= len(r.prompt_ids) <= 20 and 2 <= r.max_new_tokens <= 9 for r in reqs)
    with pytest.raises(ValueError, match="unknown arrival process 'steady'"):
        build_requests("steady", serve, np.arange(1000), seed=1)


@pytest.mark.slow
def test_compiled_engine_never_compiles_after_warmup_and_exact_compiles_each_width():
    m = model()
    padded = engine(m, max_slots=4, buckets=(32,), compile_scope="block", max_prompt_tokens=100)
    configure_compiler(padded.runner.graphs_needed() + 4)
    seconds = padded.runner.warmup()
    assert set(seconds["decode"]) == {1, 2, 4} and set(seconds["prefill"]) == {32}
    # and a prompt of three chunks among them: prefilled between decode steps through the same graph
    long_prompt = np.random.default_rng(5).integers(0, VOCAB, 90).tolist()
    requests = staggered(n=9) + [Request(9, long_prompt, 3, arrival_s=0.002)]
    with torch.compiler.set_stance("fail_on_recompile"):
        done = replay(padded, requests)
    assert not any(s.compiled for s in padded.scheduler.steps)
    eager = model()  # same weights, never compiled
    for req, c in zip(requests, done):  # compiled + padded still equals eager alone
        assert c.output_ids == generate_ids(eager, req.prompt_ids, req.max_new_tokens), req.id

    # without warmup the stance catches the first compilation (a fresh Dynamo: a new deployment)
    torch._dynamo.reset()
    cold = engine(model(), max_slots=4, buckets=(32,), compile_scope="block")
    with pytest.raises(Exception, match="(?i)recompil"):
        with torch.compiler.set_stance("fail_on_recompile"):
            replay(cold, staggered(n=3))

    # exact widths compile once per new width seen, during serving
    torch._dynamo.reset()
    exact = engine(model(), max_slots=4, buckets=(32,), compile_scope="block", exact=True)
    replay(exact, staggered(n=9))
    decode = [s for s in exact.scheduler.steps if s.kind == "decode"]
    assert sum(s.compiled for s in decode) == len({s.width for s in decode})
    assert math.isclose(sum(s.compiled for s in exact.scheduler.steps if s.kind == "prefill"), 1)


# --------------------------------------------------------------------------- the server's text, the client's figures


def byte_level_tokenizer():
    from laplace.data.tokenizer import train_tokenizer

    texts = ["The function returns the value of the key. Héllo wörld ☃ naïve café — done."] * 20
    return train_tokenizer(texts, vocab_size=300, min_frequency=1)


def test_incremental_text_equals_the_whole_decode_and_holds_back_stop_strings():
    from laplace.serving.detokenizer import IncrementalText

    tok = byte_level_tokenizer()
    text = "The value of wörld ☃ is naïve café — the key."
    ids = tok.encode(text).ids
    assert len(ids) > 10 and tok.decode(ids) == text
    inc = IncrementalText(tok)
    pieces = [inc.add(t) for t in ids]
    assert "".join(pieces) + inc.flush() == text
    assert all("\ufffd" not in p for p in pieces)  # a split character is never handed out half
    # a stop string: the text ends right before it, and the tokens after it are not counted
    inc = IncrementalText(tok, ["café", "zzz"])
    out, n = "", 0
    for t in ids:
        out += inc.add(t)
        n += 1
        if inc.stopped:
            break
    assert out + inc.flush() == text[: text.index("café")] and inc.stopped
    assert inc.consumed == n < len(ids) and "caf" not in out
    # a prefix of a stop string is held back until it is ruled out, then released
    inc = IncrementalText(tok, ["is naïve x"])
    released = "".join(inc.add(t) for t in ids)
    assert not inc.stopped and released + inc.flush() == text


def test_client_side_figures_of_a_load_run():
    from laplace.serving.loadgen import RequestResult, summarize_load, table

    results = [
        RequestResult(0, 200, 5, 0.0, 0.0, 0.5, [0.1, 0.2, 0.3], [7, 8, 9], 3),
        RequestResult(1, 200, 4, 0.5, 0.5, 1.0, [0.9, 1.0], [1, 2], 2),
        RequestResult(2, 429, 6, 0.6, 0.6, 0.61, error="queue full", retry_after="1"),
    ]
    s = summarize_load(results, ttft_slo=0.2, tpot_slo=0.2)
    assert (s["requests"], s["served"], s["failed"], s["errors_by_status"]) == (3, 2, 1, {"429": 1})
    assert s["makespan_s"] == 1.0 and s["output_tokens_per_s"] == 5.0 and s["request_throughput_rps"] == 2.0
    assert s["ttft_p50_s"] == pytest.approx(0.25) and s["ttft_max_s"] == pytest.approx(0.4)
    assert s["tpot_mean_s"] == pytest.approx(0.1) and s["itl_max_s"] == pytest.approx(0.1)
    assert s["e2e_p50_s"] == pytest.approx(0.5) and s["prompt_tokens"] == 9
    assert s["goodput_fraction"] == pytest.approx(1 / 3)  # request 1 waited 0.4 s for its first token
    assert "Output tokens/s" in table(s) and "429: 1" in table(s)
