"""laplace/serving/metrics.py: the tokens/s gauge decays when idle, and vLLM's metric names are
exported beside ours. (The live server's figures: tests/test_server.py.)"""

from __future__ import annotations

from laplace.serving.metrics import RATE_WINDOW_S, ServerMetrics, _TokenRate


def test_the_tokens_per_second_gauge_decays_to_zero_when_idle():
    rate = _TokenRate()
    rate.add(50, now=100.0)
    assert rate.per_second(now=100.0) == 50 / RATE_WINDOW_S
    assert rate.per_second(now=100.0 + RATE_WINDOW_S + 0.1) == 0.0  # read at scrape time: no step needed


def test_vllm_metric_names_are_exported_beside_ours_with_the_model_name():
    from prometheus_client.parser import text_string_to_metric_families

    m = ServerMetrics(4, "laplace-gla")
    m.count_tokens(3)
    m.occupancy(2, 1)
    families = {f.name: f for f in text_string_to_metric_families(m.exposition()[0].decode())}
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:time_per_output_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "laplace_output_tokens",
    ):
        assert name in families, name
    running = families["vllm:num_requests_running"].samples[0]
    assert running.labels == {"model_name": "laplace-gla"} and running.value == 2
    assert families["vllm:generation_tokens"].samples[0].value == 3
    # the engine's prefix-cache counters, once the engine thread has taken a snapshot
    m.prefix_cache.snapshot = {"hits": 2, "misses": 5, "bytes": 1024, "evictions": 1}
    families = {f.name: f for f in text_string_to_metric_families(m.exposition()[0].decode())}
    assert families["laplace_prefix_cache_hits"].samples[0].value == 2
    assert families["laplace_prefix_cache_bytes"].samples[0].value == 1024
