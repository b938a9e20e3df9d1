"""The cache manager (laplace/serving/cache_manager.py): one byte budget (the slot rows plus the
prefix cache's) against the state formula, slots zeroed on reuse, rows copied in and out whole."""

import numpy as np
import torch

from laplace.model.lm import LaplaceLM, analytic_state_bytes
from laplace.serving.cache_manager import CacheManager, state_tensors

from project import tiny_model_config


def test_the_byte_budget_is_the_slot_rows_plus_the_prefix_cache_by_the_formula():
    torch.manual_seed(0)
    m = LaplaceLM(tiny_model_config(40, n_layers=2)).eval()
    per_sequence = analytic_state_bytes(m.cfg)  # L*H*(K/H)*(V/H)*4 + L*(conv-1)*(2K+V)*itemsize
    cache = CacheManager(m, max_slots=3, prefix_cache_bytes=3 * per_sequence, prefix_cache_min_tokens=1)
    assert cache.bytes_per_slot == per_sequence
    assert cache.slot_bytes == 4 * per_sequence  # 3 slots and the dummy
    assert cache.memory() == {"slots": 4 * per_sequence, "slots_state": 4 * per_sequence, "slots_kv": 0,
                              "prefix_cache": 0, "prefix_cache_kv": 0, "total": 4 * per_sequence,
                              "budget": 7 * per_sequence}  # fmt: skip  (a GLA model: no K/V)
    for n in range(5):  # five one-row entries into a budget of three: two evicted
        cache.prefix_cache.put(np.arange(n + 1), cache.read_slot(0))
    assert cache.memory()["prefix_cache"] == 3 * per_sequence and cache.stats()["evictions"] == 2
    assert cache.memory()["total"] == cache.budget_bytes


def test_a_reused_slot_is_zeroed_and_rows_are_copied_whole():
    torch.manual_seed(0)
    m = LaplaceLM(tiny_model_config(40, n_layers=2)).eval()
    cache = CacheManager(m, max_slots=2)
    slot = cache.admit(owner=1)
    for t in state_tensors(cache.state).values():
        t[:, slot] = 3.0
    row = cache.read_slot(slot)
    cache.release(slot)
    again = cache.admit(owner=2)
    other = cache.admit(owner=3)
    assert {again, other} == {0, 1} and cache.free_slots == 0
    assert all(t[:, again].abs().sum() == 0 for t in state_tensors(cache.state).values())
    cache.write_slot(other, row)
    assert set(state_tensors(row)) == {"recurrent", "conv"}  # every field of the state, none left behind
    for name, t in state_tensors(cache.state).items():
        assert torch.equal(t[:, other], state_tensors(row)[name][:, 0])
