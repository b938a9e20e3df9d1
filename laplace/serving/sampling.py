"""Sampling as pure tensor functions: the counter-based uniforms and the greedy / temperature /
top-p draw. Nothing here knows about the engine (serving/generation.py drives it; the engine's
compiled decode step calls `sample_next`)."""

from __future__ import annotations

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32), in int64 without ever overflowing it (the constant is
    split into 16-bit halves), so eager, Inductor's C++ and Triton all give the same bits."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer finaliser (xor-shift-multiply; constants from Wellons' lowbias32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def stream_key(seed: int, position: int) -> int:
    """The 32-bit key of one draw: a hash of (request seed, index of the token drawn), in Python on
    the host (the engine builds each step's small per-row inputs there anyway). Any int seed works;
    only its low 64 bits count."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ position) & _MASK32


def uniforms(keys: Tensor, vocab: int) -> Tensor:
    """[B, vocab] uniforms in (0, 1), a pure function of (key, vocabulary index).

    A counter-based generator written with integer tensor ops: it runs inside a compiled (and
    CUDA-graphed) step where a torch.Generator cannot, and a request's draws do not depend on
    which other requests share its batch or on the batch width. keys [B] int64 in [0, 2^32)
    (`stream_key`). One finaliser round per value: nested rounds made Inductor's CPU compile of
    the step take minutes (its integer range analysis), and the key is already a strong hash."""
    index = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    bits = _mix32(keys.unsqueeze(-1) ^ index)  # distinct inputs per row: a bijection of them
    return ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # 24 bits: exact in fp32, never 0 or 1


def sample_next(
    logits: Tensor, temperature: Tensor | float = 0.0, top_p: Tensor | float = 1.0, keys: Tensor | int = 0
) -> Tensor:
    """Next token per row of logits [B, V]: greedy where temperature == 0, else a draw from the
    top-p nucleus of softmax(logits / temperature) by the Gumbel-max trick with the counter-based
    `uniforms` of the row's key (`stream_key(seed, token index)`). No host synchronisation and no
    data-dependent shapes: the same code runs eagerly (laplace generate, the prefill's first token)
    and inside the engine's compiled decode step. Per row: temperature, top_p [B] float; keys [B] int64."""
    logits = logits.float()
    B, V = logits.shape
    device = logits.device
    temperature = torch.as_tensor(temperature, dtype=torch.float32, device=device).expand(B)
    top_p = torch.as_tensor(top_p, dtype=torch.float32, device=device).expand(B)
    keys = torch.as_tensor(keys, dtype=torch.int64, device=device).expand(B)
    greedy = logits.argmax(-1)
    scaled = logits / temperature.clamp(min=1e-6).unsqueeze(-1)
    probs = torch.softmax(scaled, dim=-1)
    # The nucleus: the fewest most-likely tokens whose mass reaches top_p (the top token always).
    # Kept as a probability threshold, so ties at the edge are all in or all out, whatever the sort order.
    sorted_probs = probs.sort(dim=-1, descending=True).values
    before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly before each candidate
    threshold = sorted_probs.masked_fill(before >= top_p.unsqueeze(-1), float("inf")).amin(-1, keepdim=True)
    gumbel = -torch.log(-torch.log(uniforms(keys, V)))
    scores = torch.where(probs >= threshold, scaled + gumbel, float("-inf"))
    return torch.where(temperature > 0, scores.argmax(-1), greedy)
