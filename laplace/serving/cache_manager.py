"""The engine's memory: the slots, the per-sequence state in them, and the state prefix cache.

As vLLM v1's KV cache manager owns the KV blocks and their prefix cache, this owns the fixed
pool of `max_slots + 1` state rows (the last one a dummy that padding rows read and write, so a
pad row never touches a live sequence), who holds which slot, and the prefix cache of prompt
states (serving/prefix_cache.py), within one byte budget: the slots' bytes plus the prefix
cache's.

The per-slot state is the model's `State` (laplace/model/lm.py), handled whole: every field is
a tensor with the slot at dimension 1 (or None), so another kind of per-sequence state (a
static-shape attention K/V cache up to the engine's context) is one more field there, and the
slots, the model runner's buffers and the prefix cache carry it without a change here.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import deque
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

from laplace.errors import InputError
from laplace.model.lm import LaplaceLM, State
from laplace.serving.prefix_cache import PrefixCache


def state_tensors(state: State) -> dict[str, Tensor]:
    """The tensors of a State by field name (fields that are None left out), slot at dimension 1."""
    out = {}
    for f in dataclasses.fields(state):
        value = getattr(state, f.name)
        if isinstance(value, Tensor):
            out[f.name] = value
    return out


class SlotPool:
    """max_slots state rows for live sequences plus one dummy row (index max_slots) for padding."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.dummy = capacity
        self._free: deque[int] = deque(range(capacity))
        self._owner: dict[int, int] = {}

    def acquire(self, request_id: int) -> int:
        if not self._free:
            raise RuntimeError(f"no free slot: all {self.capacity} are owned")
        slot = self._free.popleft()
        self._owner[slot] = request_id
        return slot

    def release(self, slot: int) -> None:
        if slot not in self._owner:
            raise RuntimeError(f"slot {slot} released twice")
        del self._owner[slot]
        self._free.append(slot)

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def busy(self) -> int:
        return len(self._owner)

    @property
    def owners(self) -> dict[int, int]:
        return dict(self._owner)


class CacheManager:
    """The slot pool, the state rows behind it and the prefix cache of prompt states."""

    def __init__(
        self,
        model: LaplaceLM,
        max_slots: int,
        prefix_cache_bytes: int = 0,
        prefix_cache_min_tokens: int = 1,
        max_context: int | None = None,
    ):
        """max_context: positions of each slot's attention K/V cache (engine.max_context; a model
        with attention layers only: a GLA model's state does not grow, so it has no such limit)."""
        self.max_slots = max_slots
        self.max_context = max_context if model.cfg.attn_layers else None
        # the model runner's buffers: the same memory
        self.state: State = model.allocate_state(max_slots + 1, max_context=self.max_context)
        self.device = self.state.recurrent.device
        self.pool = SlotPool(max_slots)
        self.prefix_cache = PrefixCache(prefix_cache_bytes, prefix_cache_min_tokens)

    # -- bytes ----------------------------------------------------------------------------------

    @property
    def bytes_per_slot(self) -> int:
        """One sequence's state and K/V cache, all layers (laplace.model.lm.sequence_bytes at max_context)."""
        return self.state.bytes_per_sequence + self.state.kv_bytes_per_sequence

    @property
    def slot_bytes(self) -> int:
        """Every slot row, the dummy included: allocated once, whatever the load."""
        return self.state.nbytes + self.state.kv_nbytes

    def allocation(self) -> dict[str, int]:
        """What the slots hold, measured on the State tensors: per sequence and in all (the dummy
        row included), the fixed-size state and the attention K/V apart (issue 32 compares these)."""
        return {
            "state_bytes_per_slot": self.state.bytes_per_sequence,
            "kv_bytes_per_slot": self.state.kv_bytes_per_sequence,
            "state_bytes": self.state.nbytes,
            "kv_bytes": self.state.kv_nbytes,
            "max_context": self.max_context or 0,
        }

    @property
    def budget_bytes(self) -> int:
        """The one budget: the slot rows plus the prefix cache's (engine.prefix_cache_bytes)."""
        return self.slot_bytes + self.prefix_cache.budget_bytes

    def memory(self) -> dict[str, int]:
        """Bytes held now: the slot rows, the prefix cache's entries, their sum, and the budget."""
        held = self.prefix_cache.bytes
        return {
            "slots": self.slot_bytes,
            "slots_state": self.state.nbytes,
            "slots_kv": self.state.kv_nbytes,
            "prefix_cache": held,
            "prefix_cache_kv": self.prefix_cache.kv_bytes,
            "total": self.slot_bytes + held,
            "budget": self.budget_bytes,
        }

    # -- slots ----------------------------------------------------------------------------------

    @property
    def dummy(self) -> int:
        return self.pool.dummy

    @property
    def free_slots(self) -> int:
        return self.pool.free

    def admit(self, owner: int) -> int:
        """A free slot for `owner`, zeroed: a reused slot must not carry its last sequence's state."""
        slot = self.pool.acquire(owner)
        self.state.zero_(torch.tensor([slot], device=self.device))
        return slot

    def release(self, slot: int) -> None:
        self.pool.release(slot)

    @contextlib.contextmanager
    def leased(self, owners: Iterable[int]) -> Iterator[list[int]]:
        """One admitted slot per owner for the block (slots by hand: the probes, the numerics check,
        the lm-eval harness); all released after it, whatever happens."""
        slots: list[int] = []
        try:
            for owner in owners:
                slots.append(self.admit(owner))
            yield slots
        finally:
            for slot in slots:
                self.release(slot)

    def check_room(self, slot: int, tokens: int) -> None:
        """Raise InputError unless `slot`'s K/V cache has room for `tokens` more (attention models)."""
        if self.max_context is None:
            return
        held = int(self.state.positions[0, slot])
        if held + tokens > self.max_context:
            raise InputError(
                f"{held} + {tokens} tokens do not fit the slot's K/V cache: engine.max_context={self.max_context}"
            )

    def reset(self) -> None:
        """Every slot free and zeroed, the prefix cache empty (its counters too)."""
        self.prefix_cache.clear()
        self.pool = SlotPool(self.max_slots)
        self.state.zero_()

    # -- rows in and out (the prefix cache's copies) ----------------------------------------------

    def read_slot(self, slot: int) -> State:
        """A copy of one slot's state (batch 1); of the K/V cache only the positions its sequence
        has written (the tokens up to the junction, for the prefix cache)."""
        rows = torch.tensor([slot], device=self.device)
        written = None if self.state.positions is None else int(self.state.positions[0, slot])
        return self.state.select(rows, kv_tokens=written)

    def write_slot(self, slot: int, row: State) -> None:
        """Copy a one-row state (a cached prefix's) into `slot`, every field (K/V into its first positions)."""
        self.state.restore(torch.tensor([slot], device=self.device), row)

    def stats(self) -> dict[str, int]:
        """The prefix cache's counters: hits and misses (requests that did or did not start from a
        cached prefix), bytes held, evictions; also entries and hit_tokens (prefill saved)."""
        return self.prefix_cache.stats()
