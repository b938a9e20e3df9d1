"""The live server's parts without a server: the stop-string matcher against a naive search, its
linear time on a long stop string, the request model's 400s for JSON of any shape, the decaying
tokens/s gauge, and vLLM's metric names. (The server itself: tests/test_server.py.)"""

from __future__ import annotations

import random
import time

import pytest

from laplace.serving.detokenizer import IncrementalText, StopMatcher
from laplace.serving.metrics import RATE_WINDOW_S, ServerMetrics, _TokenRate
from laplace.serving.protocol import ApiError, parse_request


def naive_first_stop(text: str, stops: list[str]) -> tuple[int, int] | None:
    """The stop string that is complete earliest (the longest where two end together), by brute force."""
    for end in range(1, len(text) + 1):
        found = [s for s in stops if text[:end].endswith(s)]
        if found:
            s = max(found, key=len)
            return end - len(s), end
    return None


def test_the_stop_matcher_equals_a_naive_search_and_its_hold_back_is_the_longest_open_prefix():
    rng = random.Random(0)
    for _ in range(2000):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 30)))
        m = StopMatcher(stops)
        got, fed = None, 0
        for piece in [text[i : i + 3] for i in range(0, len(text), 3)]:  # fed in pieces, as tokens arrive
            hit = m.feed(piece)
            if hit is not None:
                got = (fed + hit[0], fed + hit[1])
                break
            fed += len(piece)
            open_prefix = max((k for s in stops for k in range(1, len(s)) if text[:fed].endswith(s[:k])), default=0)
            assert m.hold_back == open_prefix, (stops, text[:fed])
        assert got == naive_first_stop(text, stops), (stops, text)


def test_a_200_kb_stop_string_is_matched_in_linear_time():
    """The worst case of the old hold-back (a stop string whose every prefix ends the text): quadratic,
    it took 10.6 s for 8 tokens. Linear, 400,000 characters take well under a second on a quiet core;
    the bound (5 s) only separates linear from quadratic (hours) on a loaded machine."""
    stop = "a" * 200_000 + "b"
    m = StopMatcher([stop])
    started = time.perf_counter()
    for _ in range(100):
        assert m.feed("a" * 2_000) is None
    assert m.hold_back == 200_000
    assert m.feed("b") == (-200_000, 1)  # offsets in this piece: it ends at its "b", began 200,000 before
    seconds = time.perf_counter() - started
    assert seconds < 5.0, seconds


def test_incremental_text_includes_the_stop_string_when_asked():
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "c": 2, "[UNK]": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    for include, want in ((False, "a "), (True, "a b")):  # WordLevel decodes with spaces between words
        inc = IncrementalText(tok, ["b"], include_stop=include)
        out = "".join(inc.add(t) for t in (0, 1, 2))
        assert inc.stopped and out == want and inc.consumed == 2


@pytest.mark.parametrize(
    "raw, words",
    [
        (b"[" * 100_000 + b"]" * 100_000, "invalid JSON"),  # nested 100,000 deep: was a RecursionError, 500
        (b'{"model": "m", "prompt": ' + b"9" * 5001 + b"}", "invalid JSON"),  # was int's digit limit, 500
        (b'{"model": "m", "prompt": "\\ud800"}', "invalid JSON"),  # a lone surrogate: was a 500 in the tokenizer
        (b'{"model": "m", "prompt": "\\udc00x"}', "invalid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'{"model": "m", "max_tokens": "5"}', "max_tokens: input should be a valid integer"),
        (b'{"model": "m", "repetition_penalty": 1.2}', "repetition_penalty is not supported"),
        (b'{"model": "m", "top_k": 5}', "top_k is not supported"),
        (b'{"model": "m", "min_tokens": 3}', "min_tokens is not supported"),
        (b'{"model": "m", "n": 2, "best_of": 3}', "best_of = n"),
        (b'{"model": "m", "stream_options": {"include_usages": true}}', "unknown field"),
    ],
)
def test_json_of_any_shape_and_fields_that_change_results_are_400s(raw, words):
    with pytest.raises(ApiError) as caught:
        parse_request(raw)
    assert caught.value.status == 400 and words in caught.value.message
    assert "\n" not in caught.value.message


def test_vllm_fields_at_neutral_values_are_accepted_and_unknown_ones_ignored():
    raw = (
        b'{"model": "m", "prompt": "x", "repetition_penalty": 1.0, "logprobs": null, "top_k": -1, "min_p": 0.0,'
        b' "min_tokens": 0, "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true},'
        b' "user": "u", "request_id": "r", "maxtokens": 3}'
    )
    req, ignored = parse_request(raw)
    assert req.ignore_eos and req.stream and req.stream_options.include_usage
    assert ignored == ["maxtokens"]  # user / request_id change nothing: not even logged


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
