"""laplace/serving/protocol.py: the request model's 400s for JSON of any shape and for fields that
change results, and vLLM's fields accepted at neutral values. (The whole server: tests/test_server.py.)"""

from __future__ import annotations

import pytest

from laplace.serving.protocol import ApiError, parse_request


@pytest.mark.parametrize(
    "raw, words",
    [
        (b"[" * 100_000 + b"]" * 100_000, "invalid JSON"),  # nested 100,000 deep: was a RecursionError, 500
        (b'{"model": "m", "prompt": ' + b"9" * 5001 + b"}", "invalid JSON"),  # was int's digit limit, 500
        (b'{"model": "m", "prompt": "\\ud800"}', "invalid JSON"),  # a lone surrogate: was a 500 in the tokenizer
        (b'{"model": "m", "prompt": "\\udc00x"}', "invalid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'{"model": "m", "max_tokens": "5"}', "max_tokens: input should be a valid integer"),
        # vLLM's sampling fields, at vLLM's ranges
        (b'{"model": "m", "repetition_penalty": 0}', "repetition_penalty: input should be greater than 0"),
        (b'{"model": "m", "top_k": -2}', "top_k: input should be greater than or equal to -1"),
        (b'{"model": "m", "min_tokens": -1}', "min_tokens: input should be greater than or equal to 0"),
        (b'{"model": "m", "presence_penalty": 2.5}', "presence_penalty: input should be less than or equal to 2"),
        (b'{"model": "m", "logprobs": 21}', "logprobs: input should be less than or equal to 20"),
        (b'{"model": "m", "min_p": 0.1}', "min_p is not supported"),
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
