"""State prefix caching at any token boundary: the recurrent and conv state after a prompt
prefix, kept in an LRU cache with a byte budget and keyed by the prefix's token ids.

A recurrent model's state after a prefix is a fixed-size summary of it (one slot row, the
same bytes whatever the prefix length), so a prompt that starts with a cached prefix needs
only the rest prefilled, and any token boundary can be cached (a KV cache can only share
whole blocks; vLLM caches recurrent state only on its block grid).

Which prefixes are stored (the engine decides, through `plan`):
- every prompt, whole, after its prefill: a later prompt that continues it (the next turn
  of a conversation: the prompt so far, the reply, new user text) prefills only the new part;
- the longest prefix a prompt shares with a prompt already cached, when it is longer than
  the longest cached prefix it starts with and at least `min_tokens` long: the prefill is
  split there and the state at the split is stored. A shared system prompt followed by
  different user text is therefore cached at exactly where the prompts diverge (the system
  prompt, plus whatever user text they happen to share) on its second sighting, and hit
  from the third on, whatever its length and wherever the prefill buckets fall.

A lookup compares the prompt with every cached key (a vectorised comparison per entry):
entries number in the hundreds at most (the budget divided by one state row), so a trie
would save little. The cache holds copies of state rows on the engine's device.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from laplace.model.lm import State


@dataclass
class _Entry:
    tokens: np.ndarray  # the prefix's token ids (int64)
    state: State  # one row: recurrent [L, 1, ...], conv [L, 1, ...]
    nbytes: int


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
        self.bytes = self.kv_bytes = 0  # kv_bytes: the part of bytes that is attention K/V
        self.hits = self.misses = self.evictions = self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def plan(self, prompt: np.ndarray) -> tuple[int, State | None, int | None]:
        """How to prefill `prompt` (at least its last token is always prefilled, for its logits):
        (cached prefix length, its state or None, the split point to store or None). Counts a
        hit or a miss and marks the entry used."""
        n = len(prompt)
        best_key, best_len, shared = None, 0, 0
        for key, entry in self._entries.items():
            k = common_prefix(prompt[: n - 1], entry.tokens)
            if k == len(entry.tokens) and k > best_len:  # the whole entry is a prefix of the prompt
                best_key, best_len = key, k
            shared = max(shared, k)
        split = shared if shared > best_len and shared >= self.min_tokens else None
        if best_key is None:
            self.misses += 1
            return 0, None, split
        self._entries.move_to_end(best_key)
        self.hits += 1
        self.hit_tokens += best_len
        return best_len, self._entries[best_key].state, split

    def put(self, tokens: np.ndarray, state: State) -> None:
        """Store a copy-owning state row for this prefix, evicting the least recently used entries
        beyond the budget (a row larger than the whole budget is not stored)."""
        if not self.enabled:
            return
        key = tuple(int(t) for t in tokens)
        nbytes = state.nbytes + state.kv_nbytes  # a hybrid's row carries its K/V up to the prefix's end
        if nbytes > self.budget_bytes:
            return
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        self._entries[key] = _Entry(np.asarray(tokens, dtype=np.int64).copy(), state, nbytes)
        self.bytes += nbytes
        self.kv_bytes += state.kv_nbytes
        while self.bytes > self.budget_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.nbytes
            self.kv_bytes -= old.state.kv_nbytes
            self.evictions += 1

    def stats(self) -> dict[str, int]:
        return {
            "hits": self.hits,
            "misses": self.misses,
            "bytes": self.bytes,
            "kv_bytes": self.kv_bytes,
            "evictions": self.evictions,
            "entries": len(self._entries),
            "hit_tokens": self.hit_tokens,
        }
