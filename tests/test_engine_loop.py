"""The engine thread's admission (laplace/serving/engine_loop.py), without HTTP: Retry-After for a
full queue is the estimated drain time, and spreads a refused burst over it; an echo's prompt
log-probs go out as its chunked prefill ends, before its first token."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from laplace.config import EngineSection
from laplace.model.lm import LaplaceLM
from laplace.serving.engine import DecodeEngine
from laplace.serving.engine_loop import EngineLoop, QueueFull, Ticket
from laplace.serving.metrics import ServerMetrics
from laplace.serving.scheduler import Request

from project import tiny_model_config


def test_retry_after_is_the_drain_time_of_what_is_ahead_and_spreads_a_refused_burst():
    torch.manual_seed(0)
    model = LaplaceLM(tiny_model_config(64))
    shapes = dict(max_slots=2, widths=[], prefill_buckets=[16], max_prompt_tokens=16, max_queue=4)
    engine = DecodeEngine(model, dataclasses.replace(EngineSection(), **shapes), "padded", compiled=False)
    loop = EngineLoop(engine, ServerMetrics(2))  # not started: submissions stay in its inbox
    events: asyncio.Queue = asyncio.Queue()

    def ticket():
        return [Ticket(Request(loop.next_id(), [1, 2, 3], 4), 0, events)]

    for _ in range(4):
        loop.submit(ticket())
    # no completions yet: 1 request/s assumed; then 10 requests/s (11 finished over one second)
    refused = []
    for _ in range(3):
        with pytest.raises(QueueFull) as exc:
            loop.submit(ticket())
        refused.append(exc.value.retry_after_s)
    assert refused == [2, 3, 4]  # the k-th refused client waits for the k before it, plus itself
    loop._done_rate.extend(i / 10 for i in range(11))
    burst = []
    for _ in range(136):
        with pytest.raises(QueueFull) as exc:
            loop.submit(ticket())
        burst.append(exc.value.retry_after_s)
    assert burst == sorted(burst) and burst[0] == 1 and burst[-1] == 14  # ceil((3 + 136 + 1) / 10)
    # once the queue has room again the count starts over
    loop._shared.inbox.popleft()
    loop.submit(ticket())
    with pytest.raises(QueueFull) as exc:
        loop.submit(ticket())
    assert exc.value.retry_after_s == 1


def test_an_echo_gets_its_prompt_log_probs_as_its_chunked_prefill_ends_before_its_first_token():
    """echo + logprobs through the loop (turned by hand, its events delivered at once): the prompt's
    log-probs come once its prefill ends, a chunk per step, just before its first token; a request
    already streaming receives a token per chunk meanwhile. One that ends first gets its end only."""
    torch.manual_seed(0)
    model = LaplaceLM(tiny_model_config(64))
    shapes = dict(max_slots=2, widths=[], prefill_buckets=[16], max_prompt_tokens=64)
    engine = DecodeEngine(model, dataclasses.replace(EngineSection(), **shapes), "padded", compiled=False)
    loop = EngineLoop(engine, ServerMetrics(2))
    loop._aio = SimpleNamespace(call_soon_threadsafe=lambda deliver, events: deliver(events))
    engine.scheduler.on_token = loop._on_token  # as the engine thread sets them up
    loop._emitted = []
    events: asyncio.Queue = asyncio.Queue()  # one queue for both, so their order is kept

    def drain() -> list:
        return [events.get_nowait() for _ in range(events.qsize())]

    def run() -> list:
        while loop._shared.inbox or engine.scheduler.has_work():
            loop._iterate()
        return drain()

    loop.submit([Ticket(Request(loop.next_id(), [1, 2, 3], 12), 0, events)])
    loop._iterate()  # admitted: its first token, and a decode step's
    assert [kind for _, kind, _ in drain()] == ["token", "token"]
    prompt = torch.randint(0, 64, (50,), generator=torch.Generator().manual_seed(1)).tolist()
    loop.submit([Ticket(Request(loop.next_id(), prompt, 2, logprobs=1, prompt_logprobs=1), 1, events)])
    got = run()
    assert [kind for index, kind, _ in got if index == 1] == ["prompt", "logprobs", "token", "logprobs", "token", "end"]
    at = next(i for i, (_, kind, _) in enumerate(got) if kind == "prompt")
    assert [(index, kind) for index, kind, _ in got[:at]] == [(0, "token")] * 3  # 50 tokens: 16, 16, 16, then 2
    prompt_logprobs = got[at][2]
    assert len(prompt_logprobs) == 50 and prompt_logprobs[0] is None
    assert all(len(top) == 1 for _, top in prompt_logprobs[1:])

    # cancelled between its chunks: its end comes, no prompt log-probs
    rid = loop.next_id()
    loop.submit([Ticket(Request(rid, prompt, 2, prompt_logprobs=1), 1, events)])
    loop._iterate()  # admitted: its first chunk
    loop.cancel(rid, "client disconnected")
    assert [(index, kind) for index, kind, _ in run()] == [(1, "end")]
