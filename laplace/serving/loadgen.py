"""A client-side load generator for an OpenAI-compatible /v1/completions server, in the manner
of `vllm bench serve`.

The seeded workloads of serve-check (serving/workload.py: Poisson, bursty or all-at-once
arrivals, prompts that are windows of real validation text, log-uniform lengths) are sent
at their arrival times in wall-clock time by an async HTTP client (httpx), each request its
own task, streamed (server-sent events) unless asked otherwise. Every figure is measured on
the client: time to first token (TTFT), time per output token after the first (TPOT),
inter-token latency (ITL), end-to-end latency, output tokens/s and requests/s over the run,
goodput under the SLOs, and errors by HTTP status.

Prompts are sent as token ids with `ignore_eos`, so a request asks for exactly the tokens
the replayed one decodes and the live figures compare with the replay's.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field

from laplace.serving.replay import percentile
from laplace.serving.scheduler import Request


@dataclass
class RequestResult:
    id: int
    status: int | str  # the HTTP status, or "connection_error" / "timeout"
    prompt_tokens: int
    scheduled_s: float  # the arrival time the workload gave it
    sent_s: float
    end_s: float
    token_times: list[float] = field(default_factory=list)  # when each token arrived (streamed)
    output_ids: list[int] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""
    retry_after: str | None = None  # the Retry-After header of a 429

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.sent_s if self.token_times else None

    @property
    def tpot_s(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.sent_s


def payload(req: Request, model: str, stream: bool) -> dict:
    body = {
        "model": model,
        "prompt": list(req.prompt_ids),
        "max_tokens": req.max_new_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "seed": req.seed,
        "stream": stream,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def _send(client, url: str, req: Request, model: str, stream: bool, start: float) -> RequestResult:
    import httpx

    await asyncio.sleep(max(0.0, start + req.arrival_s - time.perf_counter()))
    sent = time.perf_counter() - start
    result = RequestResult(req.id, 0, len(req.prompt_ids), req.arrival_s, sent, sent)
    try:
        if not stream:
            response = await client.post(url, json=payload(req, model, False))
            result.status = response.status_code
            result.retry_after = response.headers.get("retry-after")
            if response.status_code == 200:
                body = response.json()
                result.output_ids = body["choices"][0].get("token_ids") or []
                result.output_tokens = body["usage"]["completion_tokens"]
                result.token_times = [time.perf_counter() - start]
            else:
                result.error = response.text[:300]
        else:
            async with client.stream("POST", url, json=payload(req, model, True)) as response:
                result.status = response.status_code
                result.retry_after = response.headers.get("retry-after")
                if response.status_code != 200:
                    result.error = (await response.aread()).decode(errors="replace")[:300]
                else:
                    async for line in response.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        now = time.perf_counter() - start
                        event = json.loads(line[6:])
                        if "error" in event:
                            result.error = event["error"].get("message", "error")[:300]
                            break
                        if event.get("usage"):
                            result.output_tokens = event["usage"]["completion_tokens"]
                        for choice in event.get("choices", []):
                            ids = choice.get("token_ids")
                            if ids is None:  # a server without token ids: a non-empty chunk is a token
                                ids = [-1] if choice.get("text") else []
                            for token in ids:
                                result.token_times.append(now)
                                result.output_ids.append(token)
                    if not result.output_tokens:
                        result.output_tokens = len(result.output_ids)
    except httpx.TimeoutException as exc:
        result.status, result.error = "timeout", f"{type(exc).__name__}: {exc}"[:300]
    except httpx.HTTPError as exc:
        result.status, result.error = "connection_error", f"{type(exc).__name__}: {exc}"[:300]
    result.end_s = time.perf_counter() - start
    return result


async def run_load_async(
    base_url: str,
    requests: list[Request],
    model: str,
    *,
    stream: bool = True,
    timeout_s: float = 600.0,
    max_connections: int | None = None,
) -> tuple[list[RequestResult], float]:
    """Send every request at its arrival_s (seconds after the start); (results by id, wall seconds).
    No connection limit by default: an open-loop client must not queue requests itself."""
    import httpx

    url = base_url.rstrip("/") + "/v1/completions"
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30.0), limits=limits) as client:
        start = time.perf_counter()
        tasks = [asyncio.create_task(_send(client, url, r, model, stream, start)) for r in requests]
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    return sorted(results, key=lambda r: r.id), wall


def run_load(base_url: str, requests: list[Request], model: str, **kwargs) -> tuple[list[RequestResult], float]:
    return asyncio.run(run_load_async(base_url, requests, model, **kwargs))


def served_model(base_url: str, timeout_s: float = 10.0) -> str:
    """The id of the (first) model a server serves, from GET /v1/models."""
    import httpx

    response = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=timeout_s)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def _dist(values: list[float], prefix: str) -> dict:
    out = {f"{prefix}_mean_s": sum(values) / len(values) if values else None}
    for q in (50, 90, 99):
        out[f"{prefix}_p{q}_s"] = percentile(values, q)
    out[f"{prefix}_max_s"] = max(values) if values else None
    return out


def summarize_load(results: list[RequestResult], ttft_slo: float, tpot_slo: float) -> dict:
    """Client-side figures of one run (the keys match serving.replay.summarize where they mean
    the same thing)."""
    ok = [r for r in results if r.ok]
    statuses = Counter(str(r.status) for r in results if not r.ok)
    begin = min((r.scheduled_s for r in results), default=0.0)
    makespan = max((r.end_s for r in ok), default=begin) - begin
    out_tokens = sum(r.output_tokens for r in ok)
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    itl = [x for r in ok for x in r.itl_s]
    e2e = [r.e2e_s for r in ok]
    good = [r for r in ok if (r.ttft_s or 0) <= ttft_slo and (r.tpot_s is None or r.tpot_s <= tpot_slo)]
    return {
        "requests": len(results),
        "served": len(ok),
        "failed": len(results) - len(ok),
        "errors_by_status": dict(sorted(statuses.items())),
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "output_tokens": out_tokens,
        "makespan_s": makespan,
        "output_tokens_per_s": out_tokens / makespan if makespan > 0 else 0.0,
        "request_throughput_rps": len(ok) / makespan if makespan > 0 else 0.0,
        **_dist(ttft, "ttft"),
        **_dist(tpot, "tpot"),
        **_dist(itl, "itl"),
        **_dist(e2e, "e2e"),
        "send_lag_max_s": max((r.sent_s - r.scheduled_s for r in results), default=0.0),
        "goodput_fraction": len(good) / len(results) if results else 0.0,
        "goodput_rps": len(good) / makespan if makespan > 0 else 0.0,
    }


def table(summary: dict, title: str = "serving benchmark (client side)") -> str:
    """The summary as a `vllm bench serve`-like table."""

    def ms(key: str) -> str:
        v = summary.get(key)
        return "-" if v is None else f"{1000 * v:.2f}"

    rows = [
        ("Requests sent / served", f"{summary['requests']} / {summary['served']}"),
        ("Errors by status", ", ".join(f"{k}: {v}" for k, v in summary["errors_by_status"].items()) or "none"),
        ("Duration (s)", f"{summary['makespan_s']:.2f}"),
        ("Prompt tokens / output tokens", f"{summary['prompt_tokens']} / {summary['output_tokens']}"),
        ("Output tokens/s", f"{summary['output_tokens_per_s']:.1f}"),
        ("Requests/s", f"{summary['request_throughput_rps']:.2f}"),
        ("Goodput (requests within SLOs)", f"{summary['goodput_fraction']:.1%} ({summary['goodput_rps']:.2f}/s)"),
    ]
    for name, key in (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2E", "e2e")):
        rows.append(
            (
                f"{name} mean / p50 / p90 / p99 / max (ms)",
                " / ".join(ms(f"{key}_{s}_s") for s in ("mean", "p50", "p90", "p99", "max")),
            )
        )
    width = max(len(r[0]) for r in rows)
    line = "=" * (width + 40)
    return "\n".join([line, title.center(width + 40), line, *(f"{k:<{width}}  {v}" for k, v in rows), line])
