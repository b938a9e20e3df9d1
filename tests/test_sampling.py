"""vLLM's sampling fields as laplace/serving/sampling.py computes them, each against a reference
written here from vLLM's definitions (vllm/model_executor/layers/utils.py apply_penalties,
vllm/v1/sample/ops/topk_topp_sampler.py apply_top_k_top_p, the min_tokens logits processor):
plain per-row Python / numpy loops in float64, compared with the batched tensor functions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from laplace.serving.sampling import (
    apply_min_tokens,
    apply_penalties,
    logprobs_of,
    sample_next,
    sampling_probs,
    stream_key,
    token_counts,
)

V = 11


def reference_penalties(logits, prompt, output, rep, freq, pres):
    """vLLM's apply_penalties for one row, token by token."""
    out = []
    for t, x in enumerate(logits):
        count = output.count(t)
        if t in prompt or count:
            x = x / rep if x > 0 else x * rep
        x = x - freq * count - pres * (1.0 if count else 0.0)
        out.append(x)
    return out


def reference_top_k_top_p(logits, k, p):
    """vLLM's apply_top_k_top_p for one row (numpy, float64): ascending sort, mask below the k-th
    largest, softmax, mask the prefix whose cumulative mass is <= 1 - p (the largest always kept)."""
    x = np.asarray(logits, dtype=np.float64)
    order = np.argsort(x, kind="stable")
    s = x[order].copy()
    if k is not None and 0 < k < len(x):
        s[s < s[len(x) - k]] = -np.inf
    probs = np.exp(s - s.max())
    probs /= probs.sum()
    cum = np.cumsum(probs)
    drop = cum <= 1 - p
    drop[-1] = False
    s[drop] = -np.inf
    allowed = np.zeros(len(x), dtype=bool)
    allowed[order] = np.isfinite(s)
    return allowed


def test_penalties_equal_vllms_definition_row_by_row():
    g = torch.Generator().manual_seed(0)
    B = 6
    logits = torch.randn(B, V, generator=g, dtype=torch.float64) * 3
    prompts = [[1, 2, 2], [0], [5, 6, 7, 8], [3], [10, 1], [4]]
    outputs = [[2, 2, 3], [], [9, 9, 9, 5], [3, 4], [0], [4, 4]]
    rep = [1.0, 1.3, 0.7, 2.0, 1.1, 1.0]
    freq = [0.0, 0.5, -0.3, 1.0, 2.0, 0.0]
    pres = [0.0, -1.0, 0.4, 0.2, -2.0, 1.5]
    prompt_mask = torch.zeros(B, V, dtype=torch.bool)
    for i, p in enumerate(prompts):
        prompt_mask[i, p] = True
    longest = max(len(o) for o in outputs)
    padded = torch.tensor([o + [0] * (longest - len(o)) for o in outputs])
    valid = torch.tensor([[j < len(o) for j in range(longest)] for o in outputs])
    counts = token_counts(padded, V, valid)
    assert counts[2].tolist() == [0, 0, 0, 0, 0, 1, 0, 0, 0, 3, 0]
    got = apply_penalties(
        logits, prompt_mask, counts, torch.tensor(rep), torch.tensor(freq), torch.tensor(pres)
    ).double()
    for i in range(B):
        want = reference_penalties(logits[i].tolist(), prompts[i], outputs[i], rep[i], freq[i], pres[i])
        assert torch.allclose(got[i], torch.tensor(want, dtype=torch.float64), atol=1e-5), i  # fp32 compute
    # neutral values change nothing
    same = apply_penalties(logits, prompt_mask, counts, 1.0, 0.0, 0.0)
    assert torch.equal(same, logits.float())


def test_min_tokens_masks_the_stop_tokens_until_enough_are_generated():
    logits = torch.zeros(3, V)
    logits[:, 2] = 10.0  # EOS (id 2) would win
    stop_mask = torch.zeros(3, V, dtype=torch.bool)
    stop_mask[:, 2] = True
    stop_mask[1, 7] = True  # a stop_token_id of row 1
    out = apply_min_tokens(logits, stop_mask, torch.tensor([0, 1, 5]), torch.tensor([3, 2, 5]))
    for row, (generated, minimum) in enumerate(((0, 3), (1, 2), (5, 5))):
        for t in range(V):
            masked = bool(stop_mask[row, t]) and generated < minimum  # vLLM: len(output) < min_tokens
            assert (out[row, t] == -math.inf) == masked
    assert sample_next(out, 0.0).tolist() == [0, 0, 2]  # greedy never picks a masked stop token


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_top_k_and_top_p_keep_the_tokens_vllm_keeps(temperature):
    g = torch.Generator().manual_seed(1)
    cases = [(k, p) for k in (None, 1, 2, 3, 5, V, 0, -1) for p in (1.0, 0.9, 0.5, 0.2)]
    logits = torch.randn(len(cases), V, generator=g) * 2
    top_k = torch.tensor([k if k is not None else 0 for k, _ in cases])
    top_p = torch.tensor([p for _, p in cases])
    _, allowed = sampling_probs(logits, temperature, top_p, top_k)
    for i, (k, p) in enumerate(cases):
        want = reference_top_k_top_p((logits[i].double() / temperature).numpy(), k, p)
        assert allowed[i].numpy().tolist() == want.tolist(), (k, p)


def test_top_k_draws_follow_the_renormalised_distribution_seeded_and_batch_invariant():
    g = torch.Generator().manual_seed(2)
    row = torch.randn(V, generator=g)
    n = 20000
    keys = torch.tensor([stream_key(s, 0) for s in range(n)])
    k, temperature = 4, 0.8
    draws = sample_next(row.expand(n, V), temperature, 1.0, keys, k)
    allowed = reference_top_k_top_p((row.double() / temperature).numpy(), k, 1.0)
    probs = np.where(allowed, np.exp(row.double().numpy() / temperature), 0.0)
    probs /= probs.sum()
    freq = np.bincount(draws.numpy(), minlength=V) / n
    assert set(np.flatnonzero(freq)) <= set(np.flatnonzero(allowed))
    sigma = np.sqrt(probs * (1 - probs) / n)
    assert np.all(np.abs(freq - probs) <= 5 * sigma + 1e-12), (freq, probs)
    # the same (row, key) draws the same token whatever shares its batch, and whatever the others' top_k
    other = torch.randn(7, V, generator=g)
    batch = torch.cat([other[:3], row[None], other[3:]])
    top_k = torch.tensor([0, 2, 9, k, 1, 0, 5, 3])
    mixed = sample_next(batch, temperature, 1.0, torch.cat([keys[:3], keys[5:6], keys[3:7]]), top_k)
    assert mixed[3] == draws[5]


def test_logprobs_are_the_raw_log_softmax():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, V, generator=g)
    tokens = torch.tensor([0, 3, 10, 5])
    chosen, top, ids = logprobs_of(logits, tokens, 3)
    ref = torch.log_softmax(logits.double(), -1)
    assert torch.allclose(chosen.double(), ref[torch.arange(4), tokens], atol=1e-6)
    assert torch.allclose(top.double(), ref.sort(-1, descending=True).values[:, :3], atol=1e-6)
    assert torch.equal(ids, ref.argsort(-1, descending=True)[:, :3])


def test_the_engine_applies_the_fields_per_slot_as_the_reference_does_batched_and_seeded():
    """Greedy requests with penalties and min_tokens decoded together (and with sampled neighbours
    using other settings) give the tokens of a reference loop: the model's parallel forward over the
    text so far, vLLM's penalties and min_tokens mask written above, argmax. A sampled request with
    top_k gives the same tokens alone and in the batch; top_k = 1 is greedy."""
    import dataclasses

    from laplace.config import EngineSection
    from laplace.model.lm import LaplaceLM
    from laplace.serving.engine import DecodeEngine
    from laplace.serving.scheduler import Request

    from project import tiny_model_config

    torch.manual_seed(0)
    vocab = 61
    model = LaplaceLM(tiny_model_config(vocab, n_layers=2, init_std=0.3)).eval()

    def engine():
        shapes = dict(max_slots=4, widths=[], prefill_buckets=[16], max_prompt_tokens=16)
        return DecodeEngine(model, dataclasses.replace(EngineSection(), **shapes), "padded", compiled=False)

    def reference(req: Request) -> list[int]:
        out: list[int] = []
        for _ in range(req.max_new_tokens):
            with torch.no_grad():
                row = model(torch.tensor([req.prompt_ids + out]))[0, -1].double().tolist()
            row = reference_penalties(
                row, req.prompt_ids, out, req.repetition_penalty, req.frequency_penalty, req.presence_penalty
            )
            if len(out) < req.min_tokens:
                row = [-math.inf if t in req.stop_ids else x for t, x in enumerate(row)]
            out.append(int(np.argmax(row)))
            if out[-1] in req.stop_ids:
                break
        return out

    prompt = [3, 7, 7, 11, 2, 5]
    plain = engine().complete([Request(0, prompt, 10)])[0].output_ids
    greedy = [
        Request(1, prompt, 10, repetition_penalty=1.8),
        Request(2, prompt, 10, frequency_penalty=1.5, presence_penalty=0.5),
        Request(3, prompt, 10, stop_ids=(plain[0], plain[1]), min_tokens=4, presence_penalty=-1.0),
    ]
    sampled = Request(4, [9, 9, 1], 10, temperature=1.0, top_k=3, seed=7, repetition_penalty=1.2)
    done = {c.request_id: c.output_ids for c in engine().complete([*greedy, sampled])}
    for req in greedy:
        assert done[req.id] == reference(req), req
    assert done[1] != plain and done[2] != plain  # the penalties changed the text
    assert not {plain[0], plain[1]} & set(done[3][:4])  # no stop token before min_tokens
    alone = engine().complete([Request(4, [9, 9, 1], 10, temperature=1.0, top_k=3, seed=7, repetition_penalty=1.2)])
    assert alone[0].output_ids == done[4]
    top1 = engine().complete([Request(5, prompt, 10, temperature=1.3, top_k=1, seed=3)])[0].output_ids
    assert top1 == plain
