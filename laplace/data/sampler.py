"""The training sampler: a batch is a pure function of (seed, step), sliced by rank."""

from __future__ import annotations

import numpy as np
import torch

from laplace.errors import DataError


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    windows = np.asarray(tokens[starts[:, None] + np.arange(seq_len + 1)], dtype=np.int64)
    stacked = torch.from_numpy(windows)
    return stacked[:, :-1].contiguous(), stacked[:, 1:].contiguous()


def _check_length(tokens: np.ndarray, seq_len: int) -> int:
    if seq_len <= 0:
        raise DataError(f"seq_len must be > 0, got {seq_len}")
    if len(tokens) < seq_len + 1:
        raise DataError(
            f"split has {len(tokens)} tokens, fewer than seq_len+1={seq_len + 1}: lower train.seq_len or use more data"
        )
    return len(tokens) - seq_len  # number of possible window starts


def sample_batch(
    tokens: np.ndarray,
    step: int,
    batch_size: int,
    seq_len: int,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the global batch for `step`: (x, y) int64 [batch_size/world_size, seq_len].

    The global batch's window starts come from a generator seeded with (seed, step) only, so a
    resumed run at step k sees the same data and ranks take contiguous slices of one batch.
    """
    if world_size <= 0 or not 0 <= rank < world_size:
        raise DataError(f"rank {rank} is not in a world of size {world_size}")
    if batch_size <= 0 or batch_size % world_size:
        raise DataError(f"batch_size {batch_size} is not divisible by world_size {world_size}")
    if step < 0:
        raise DataError(f"step must be >= 0, got {step}")
    n_starts = _check_length(tokens, seq_len)
    rng = np.random.default_rng([seed % 2**64, step])  # SeedSequence wants non-negative entropy
    starts = rng.integers(0, n_starts, size=batch_size)
    per_rank = batch_size // world_size
    return _windows(tokens, starts[rank * per_rank : (rank + 1) * per_rank], seq_len)


def validation_batches(
    tokens: np.ndarray, batch_size: int, seq_len: int, n_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """n_batches fixed batches of windows spread evenly over the split (they overlap if it is short)."""
    if batch_size <= 0 or n_batches <= 0:
        raise DataError(f"batch_size and n_batches must be > 0, got {batch_size} and {n_batches}")
    n_starts = _check_length(tokens, seq_len)
    starts = np.linspace(0, n_starts - 1, batch_size * n_batches).round().astype(np.int64)
    return [_windows(tokens, chunk, seq_len) for chunk in starts.reshape(n_batches, batch_size)]
