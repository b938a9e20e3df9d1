"""The engine thread's admission (laplace/serving/engine_loop.py), without HTTP: Retry-After for a
full queue is the estimated drain time, and spreads a refused burst over it."""

from __future__ import annotations

import asyncio
import dataclasses

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
