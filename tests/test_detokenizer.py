"""laplace/serving/detokenizer.py: the stop-string matcher against a naive search, its linear time on
a long stop string, and the stop string kept in the text when asked. (The whole server: tests/test_server.py.)"""

from __future__ import annotations

import random
import time

from laplace.serving.detokenizer import IncrementalText, StopMatcher


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
