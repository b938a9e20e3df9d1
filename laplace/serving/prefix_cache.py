"""State prefix caching at any token boundary: the recurrent and conv state after a prompt
prefix, kept in an LRU cache with a byte budget and keyed by the prefix's token ids.

A recurrent model's state after a prefix is a fixed-size summary of it (one slot row, the
same bytes whatever the prefix length), so a prompt that starts with a cached prefix needs
only the rest prefilled, and any token boundary can be cached (a KV cache can only share
whole blocks; vLLM caches recurrent state only on its block grid).

Which prefixes are stored (the engine decides, through `plan`):
- every prompt, whole, after its prefill, with its last token's logits: an exact repeat
  prefills nothing (its first token is drawn from the stored logits), and a later prompt that
  continues it (the next turn of a conversation) prefills only the new part;
- the longest prefix a prompt shares with a prompt already cached, when it is longer than
  the longest cached prefix it starts with, at least `min_tokens` long, and when it can save a
  bucket: a prompt like this one would prefill fewer padded tokens from the split than from
  where it starts now (`padded(n - split) < padded(n - start)`). The prefill is then split
  there and the state at the split is stored. A shared system prompt followed by different
  user text is so cached where the prompts diverge on its second sighting and hit from the
  third on; a split whose remainder would fill the same bucket anyway is not made (it would
  cost a second prefill piece and save nothing later).

A lookup compares the prompt with every cached key (a vectorised comparison per entry):
entries number in the hundreds at most (the budget divided by one state row), so a trie
would save little. The cache holds copies of state rows on the engine's device.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from torch import Tensor

from laplace.model.lm import State


@dataclass
class _Entry:
    tokens: np.ndarray  # the prefix's token ids (int64)
    state: State  # one row: recurrent [L, 1, ...], conv [L, 1, ...]
    logits: Tensor | None  # [1, V], the last token's: an exact repeat needs no prefill
    nbytes: int


@dataclass
class Plan:
    """How to prefill one prompt: start from `state` (the cached prefix of `start` tokens, or a
    zeroed slot when None), prefill up to `split` and store the state there (when not None), then
    prefill the rest. `logits` is set when the whole prompt is cached: nothing to prefill."""

    start: int
    state: State | None
    logits: Tensor | None
    split: int | None


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    same = a[:n] == b[:n]
    return n if same.all() else int(same.argmin())


class PrefixCache:
    """An LRU map from token-id prefixes to state rows, within `budget_bytes` (0: off)."""

    def __init__(self, budget_bytes: int, min_tokens: int = 1):
        self.budget_bytes = budget_bytes
        self.min_tokens = max(1, min_tokens)
        self._entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()
        self.clear()

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def clear(self) -> None:
        """Drop every entry and zero the counters."""
        self._entries.clear()
        self.bytes = 0
        self.hits = self.misses = self.evictions = self.hit_tokens = self.query_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def plan(self, prompt: np.ndarray, padded: Callable[[int], int] | None = None) -> Plan:
        """How to prefill `prompt`; `padded(n)` is the padded tokens the engine's bucket graphs
        compute for n tokens (default: n). Counts a hit or a miss and the tokens queried and hit,
        and marks the entry used."""
        padded = padded or (lambda k: k)
        n = len(prompt)
        self.query_tokens += n
        best_key, best_len, shared = None, 0, 0
        for key, entry in self._entries.items():
            k = common_prefix(prompt, entry.tokens)
            whole = k == len(entry.tokens) and (k < n or entry.logits is not None)
            if whole and k > best_len:  # the whole entry is a prefix of the prompt (or the prompt itself)
                best_key, best_len = key, k
            shared = max(shared, min(k, n - 1))  # a split leaves at least the last token to prefill
        start = best_len
        split = None
        if shared > start and shared >= self.min_tokens and padded(n - shared) < padded(n - start):
            split = shared
        if best_key is None:
            self.misses += 1
            return Plan(0, None, None, split)
        self._entries.move_to_end(best_key)
        self.hits += 1
        self.hit_tokens += best_len
        entry = self._entries[best_key]
        return Plan(best_len, entry.state, entry.logits if best_len == n else None, split)

    def put(self, tokens: np.ndarray, state: State, logits: Tensor | None = None) -> None:
        """Store a copy-owning state row (and the last token's logits [1, V]) for this prefix,
        evicting the least recently used entries beyond the budget (an entry larger than the whole
        budget is not stored)."""
        if not self.enabled:
            return
        key = tuple(int(t) for t in tokens)
        nbytes = state.nbytes + (logits.numel() * logits.element_size() if logits is not None else 0)
        if nbytes > self.budget_bytes:
            return
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        self._entries[key] = _Entry(np.asarray(tokens, dtype=np.int64).copy(), state, logits, nbytes)
        self.bytes += nbytes
        while self.bytes > self.budget_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.nbytes
            self.evictions += 1

    def stats(self) -> dict[str, int]:
        return {
            "hits": self.hits,
            "misses": self.misses,
            "bytes": self.bytes,
            "evictions": self.evictions,
            "entries": len(self._entries),
            "hit_tokens": self.hit_tokens,  # prompt tokens whose prefill the cache saved
            "query_tokens": self.query_tokens,  # prompt tokens looked up (vLLM's prefix_cache_queries)
        }
