"""Incremental detokenization with stop strings, in time linear in the text.

Token ids become text through `tokenizers`' `decoders.DecodeStream` (the prefix-offset decode
vLLM and TGI use, in Rust: a character split over byte-level tokens is handed out only once it
is whole). On top of it, our stop-string hold-back: text that could be the start of a stop string
is held back until it is ruled out, and at a stop string the text ends before it. The matcher is
a Knuth-Morris-Pratt automaton per stop string (written here: `tokenizers` has none, and a
`str.find` from each new character plus a suffix scan is quadratic in the stop string's length,
which let one request stall the server): each character of output costs O(1) amortised per
stop string, and the automaton's state is exactly the hold-back."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


class StopMatcher:
    """The earliest stop string in a growing text, fed a character at a time."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._fail = [_failure(s) for s in self.stops]
        self._state = [0] * len(self.stops)  # per stop: its longest prefix that ends the text so far

    def feed(self, text: str) -> tuple[int, int] | None:
        """Advance over `text`; at the first stop string completed, its (start, end) offsets in
        `text` (end exclusive; the longest one where two end at the same character)."""
        for pos, ch in enumerate(text):
            found = None
            for i, s in enumerate(self.stops):
                k, fail = self._state[i], self._fail[i]
                while k and s[k] != ch:
                    k = fail[k - 1]
                if s[k] == ch:
                    k += 1
                if k == len(s):
                    if found is None or len(s) > found:
                        found = len(s)
                    k = fail[k - 1]
                self._state[i] = k
            if found is not None:
                return pos + 1 - found, pos + 1
        return None

    @property
    def hold_back(self) -> int:
        """Characters at the end of the text that may still begin a stop string."""
        return max(self._state, default=0)


def _failure(s: str) -> list[int]:
    """KMP's failure function: fail[i] = the longest proper prefix of s[:i+1] that is also its suffix."""
    fail = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail


class IncrementalText:
    """The text of a growing list of token ids, handed out as it becomes final.

    `add(token)` returns the text that became final with that token (often "", never half a
    character, never a possible start of a stop string); `flush()` the rest at the end, an
    incomplete character included. At a stop string `stopped` is set, the text ends before it
    (or after it, with include_stop), and `consumed` counts the tokens up to the one that completed it."""

    def __init__(
        self,
        tokenizer,
        stop: list[str] = (),
        *,
        include_stop: bool = False,
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
    ):
        self.tokenizer = tokenizer
        self.min_tokens = min_tokens  # vLLM's min_tokens: no stop string ends the text before these
        self.skip_special_tokens = skip_special_tokens
        self.include_stop = include_stop
        self.ids: list[int] = []
        self.stopped = False
        self.consumed = 0  # tokens up to (and with) the one that completed a stop string
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._matcher = StopMatcher(list(stop)) if stop else None
        self._decoded: list[str] = []  # every piece DecodeStream gave, for the flush
        self._pending = ""  # decoded, not yet handed out (at most the hold-back, between calls)

    def add(self, token: int) -> str:
        if self.stopped:
            return ""
        self.ids.append(token)
        self.consumed = len(self.ids)
        piece = self._stream.step(self.tokenizer, token)
        if not piece:
            return ""
        self._decoded.append(piece)
        return self._take(piece, final=False)

    def flush(self) -> str:
        """At the end: whatever is left, an incomplete character included."""
        if self.stopped:
            return ""
        done = "".join(self._decoded)
        whole = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)
        rest = whole[len(done) :] if whole.startswith(done) else ""
        return self._take(rest, final=True)

    def _take(self, piece: str, final: bool) -> str:
        if self._matcher is None or (len(self.ids) <= self.min_tokens and not self._pending):
            return piece
        offset = len(self._pending)
        self._pending += piece
        hit = self._matcher.feed(piece)
        if hit is not None:
            start, end = hit
            out = self._pending[: offset + (end if self.include_stop else start)]
            self._pending, self.stopped = "", True
            return out
        keep = 0 if final else min(self._matcher.hold_back, len(self._pending))
        out = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(out) :]
        return out
