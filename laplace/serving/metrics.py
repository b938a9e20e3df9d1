"""The live server's Prometheus metrics: ours (`laplace_*`) and vLLM's names beside them.

prometheus_client does the exposition format and the thread-safe counters and histograms.
vLLM's metrics (`vllm:*`, labelled `model_name`, as vllm/v1/metrics/loggers.py names them) are
exported too, so a dashboard built for a vLLM server works against this one unchanged."""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
LONGER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
RATE_WINDOW_S = 10.0


class _TokenRate:
    """Output tokens per second over the last RATE_WINDOW_S, read at scrape time: an idle server
    reads 0 once the window has passed, whatever the last step was."""

    def __init__(self):
        self._lock = threading.Lock()  # appended on the engine thread, read on the event loop's
        self._window: deque[tuple[float, int]] = deque()

    def add(self, n: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._window.append((now, n))
            self._trim(now)

    def per_second(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._trim(now)
            return sum(k for _, k in self._window) / RATE_WINDOW_S

    def _trim(self, now: float) -> None:
        while self._window and self._window[0][0] < now - RATE_WINDOW_S:
            self._window.popleft()


class _PrefixCacheCollector(Collector):
    """The engine's prefix-cache counters (`CacheManager.stats()`), from the snapshot the engine
    thread takes after each step: scraping never touches the engine."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.snapshot: dict[str, int] | None = None

    def collect(self):
        stats = self.snapshot
        if stats is None:
            return
        for key, kind, doc in (
            ("hits", "counter", "requests whose prompt started with a cached state prefix"),
            ("misses", "counter", "requests that found no cached state prefix"),
            ("evictions", "counter", "cached prefixes evicted to stay within engine.prefix_cache_bytes"),
            ("bytes", "gauge", "bytes of state held by the prefix cache (recurrent, conv and attention K/V)"),
            ("kv_bytes", "gauge", "of those, bytes of attention K/V (models with attention layers)"),
        ):
            if key in stats:
                name = f"laplace_prefix_cache_{key}"
                family = CounterMetricFamily(name, doc) if kind == "counter" else GaugeMetricFamily(name, doc)
                family.add_metric([], float(stats[key]))
                yield family
        # vLLM counts prefix-cache queries and hits in tokens; exported when the engine counts tokens
        if "query_tokens" in stats and "hit_tokens" in stats:
            for name, key, doc in (
                ("vllm:prefix_cache_queries", "query_tokens", "prompt tokens looked up in the prefix cache"),
                ("vllm:prefix_cache_hits", "hit_tokens", "prompt tokens found in the prefix cache"),
            ):
                family = CounterMetricFamily(name, doc, labels=["model_name"])
                family.add_metric([self.model_name], float(stats[key]))
                yield family


class ServerMetrics:
    """The metrics of one server, in a registry of its own."""

    def __init__(self, max_slots: int, model_name: str = "laplace"):
        r = self.registry = CollectorRegistry()
        self.model_name = model_name
        self.ready = Gauge("laplace_ready", "1 once warmup is done and the server admits requests", registry=r)
        self.slots = Gauge("laplace_slots", "state slots (the most concurrent sequences)", registry=r)
        self.slots.set(max_slots)
        self.max_slots = max_slots
        self.busy_slots = Gauge("laplace_busy_slots", "slots holding a live sequence", registry=r)
        # what the slots hold, allocated once (the dummy row included): GLA state and attention K/V
        self.slot_state_bytes = Gauge(
            "laplace_slot_state_bytes", "bytes of fixed-size state (recurrent, conv) the slots hold", registry=r
        )
        self.slot_kv_bytes = Gauge(
            "laplace_slot_kv_bytes", "bytes of attention K/V cache the slots hold, up to engine.max_context", registry=r
        )
        self.queue_depth = Gauge("laplace_queue_depth", "requests waiting for a slot", registry=r)
        self.rate = _TokenRate()
        self.tokens_per_s = Gauge(
            "laplace_output_tokens_per_second", "output tokens per second over the last 10 s", registry=r
        )
        self.tokens_per_s.set_function(self.rate.per_second)
        self.warmup_seconds = Gauge("laplace_warmup_seconds", "seconds warmup took", registry=r)
        self.warmup_graphs = Gauge("laplace_warmup_graphs", "decode widths and prefill buckets warmed up", registry=r)
        self.warmup_from_cache = Gauge(
            "laplace_warmup_graphs_loaded_from_cache",
            "graphs warmup loaded from the compile cache instead of compiling",
            registry=r,
        )
        self.warmup_compiled = Gauge("laplace_warmup_graphs_compiled", "graphs warmup compiled cold", registry=r)
        self.requests = Counter(
            "laplace_requests", "engine requests by outcome (done, cancelled, failed)", ["outcome"], registry=r
        )
        self.rejections = Counter("laplace_rejections", "HTTP requests refused, by reason", ["reason"], registry=r)
        self.output_tokens = Counter("laplace_output_tokens", "tokens generated", registry=r)
        self.prompt_tokens = Counter("laplace_prompt_tokens", "prompt tokens prefilled", registry=r)
        self.compile_events = Counter(
            "laplace_compile_events", "graphs compiled while serving (after warmup; should stay 0)", registry=r
        )
        self.engine_errors = Counter("laplace_engine_errors", "engine steps that raised", ["kind"], registry=r)
        self.decode_steps = Counter("laplace_decode_steps", "decode steps by width", ["width"], registry=r)
        self.ttft = Histogram(
            "laplace_time_to_first_token_seconds", "arrival to first token", buckets=LONGER_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "laplace_inter_token_latency_seconds",
            "time between consecutive tokens",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "laplace_time_per_output_token_seconds",
            "mean per-token time after the first",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "laplace_e2e_request_latency_seconds",
            "arrival to last token",
            buckets=LONGER_BUCKETS + (120.0,),
            registry=r,
        )
        self.step_seconds = Histogram(
            "laplace_decode_step_seconds", "duration of one decode step", buckets=LATENCY_BUCKETS, registry=r
        )
        self.prefix_cache = _PrefixCacheCollector(model_name)
        r.register(self.prefix_cache)
        self._vllm(r)

    def _vllm(self, r: CollectorRegistry) -> None:
        """vLLM's names for the same figures (one label, model_name, as vLLM has)."""
        m = ["model_name"]
        name = self.model_name
        self.vllm_running = Gauge("vllm:num_requests_running", "requests in the batch", m, registry=r).labels(name)
        self.vllm_waiting = Gauge("vllm:num_requests_waiting", "requests waiting", m, registry=r).labels(name)
        self.vllm_cache_usage = Gauge(
            "vllm:kv_cache_usage_perc", "state slots in use, as a fraction (our 'KV cache')", m, registry=r
        ).labels(name)
        self.vllm_prompt_tokens = Counter("vllm:prompt_tokens", "prefilled tokens", m, registry=r).labels(name)
        self.vllm_generation_tokens = Counter("vllm:generation_tokens", "generated tokens", m, registry=r).labels(name)
        self.vllm_success = Counter(
            "vllm:request_success", "finished requests by reason", m + ["finished_reason"], registry=r
        )
        self.vllm_ttft = Histogram(
            "vllm:time_to_first_token_seconds", "time to first token", m, buckets=LONGER_BUCKETS, registry=r
        ).labels(name)
        self.vllm_itl = Histogram(
            "vllm:inter_token_latency_seconds", "inter-token latency", m, buckets=LATENCY_BUCKETS, registry=r
        ).labels(name)
        self.vllm_tpot = Histogram(
            "vllm:time_per_output_token_seconds", "time per output token", m, buckets=LATENCY_BUCKETS, registry=r
        ).labels(name)
        self.vllm_request_tpot = Histogram(
            "vllm:request_time_per_output_token_seconds",
            "time per output token, per request",
            m,
            buckets=LATENCY_BUCKETS,
            registry=r,
        ).labels(name)
        self.vllm_e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "end-to-end request latency",
            m,
            buckets=LONGER_BUCKETS + (120.0,),
            registry=r,
        ).labels(name)
        self.vllm_queue_time = Histogram(
            "vllm:request_queue_time_seconds", "time waiting for a slot", m, buckets=LONGER_BUCKETS, registry=r
        ).labels(name)
        self.vllm_prompt_hist = Histogram(
            "vllm:request_prompt_tokens", "prompt tokens per request", m, buckets=TOKEN_COUNT_BUCKETS, registry=r
        ).labels(name)
        self.vllm_generation_hist = Histogram(
            "vllm:request_generation_tokens",
            "generated tokens per request",
            m,
            buckets=TOKEN_COUNT_BUCKETS,
            registry=r,
        ).labels(name)

    # -- updated by the engine thread ----------------------------------------------------------

    def count_tokens(self, n: int) -> None:
        self.output_tokens.inc(n)
        self.vllm_generation_tokens.inc(n)
        self.rate.add(n)

    def occupancy(self, running: int, waiting: int) -> None:
        self.busy_slots.set(running)
        self.queue_depth.set(waiting)
        self.vllm_running.set(running)
        self.vllm_waiting.set(waiting)
        self.vllm_cache_usage.set(running / self.max_slots if self.max_slots else 0.0)

    def finished(self, completion, finish_reason: str | None) -> None:
        """A finished engine request: outcome counters, and the latency histograms of a done one."""
        c = completion
        self.requests.labels(c.status).inc()
        if c.status != "done":
            if c.status == "cancelled":  # a stop string ends a request by cancelling it: vLLM counts a stop
                reason = "stop" if c.reason == "stop string" else "abort"
                self.vllm_success.labels(self.model_name, reason).inc()
            return
        self.prompt_tokens.inc(c.prompt_tokens)
        self.vllm_prompt_tokens.inc(c.prompt_tokens)
        self.vllm_prompt_hist.observe(c.prompt_tokens)
        self.vllm_generation_hist.observe(len(c.output_ids))
        self.vllm_success.labels(self.model_name, finish_reason or "length").inc()
        if c.admitted_s is not None:
            self.vllm_queue_time.observe(max(0.0, c.admitted_s - c.arrival_s))
        if c.ttft_s is not None:
            self.ttft.observe(c.ttft_s)
            self.vllm_ttft.observe(c.ttft_s)
        for gap in c.itl_s:
            self.itl.observe(gap)
            self.vllm_itl.observe(gap)
            self.vllm_tpot.observe(gap)
        if c.tpot_s is not None:
            self.tpot.observe(c.tpot_s)
            self.vllm_request_tpot.observe(c.tpot_s)
        if c.e2e_s is not None:
            self.e2e.observe(c.e2e_s)
            self.vllm_e2e.observe(c.e2e_s)

    def exposition(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
