"""Sampling as pure tensor functions: the counter-based uniforms, vLLM's logits processors
(repetition / presence / frequency penalties, min_tokens) and the greedy / temperature / top-k /
top-p draw. Nothing here knows about the engine (serving/generation.py drives it; the engine's
compiled decode step calls these). Every function is batched over rows with per-row parameters,
has static shapes and reads nothing back to the host, so it runs eagerly and inside a compiled
(CUDA-graphed) step alike.

The order is vLLM's (vllm/v1/sample/sampler.py): min_tokens and the penalties change the logits
first (greedy rows take the argmax of those), then temperature, then top-k, then top-p over the
top-k set renormalised, then the draw."""

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


def token_counts(tokens: Tensor, vocab: int, valid: Tensor | None = None) -> Tensor:
    """[B, vocab] int32 counts of each token id in each row of `tokens` [B, T] (positions where
    `valid` [B, T] is False are not counted: padding)."""
    ones = torch.ones_like(tokens, dtype=torch.int32) if valid is None else valid.to(torch.int32)
    return torch.zeros(tokens.shape[0], vocab, dtype=torch.int32, device=tokens.device).scatter_add_(1, tokens, ones)


def apply_penalties(
    logits: Tensor,
    prompt_mask: Tensor,
    output_counts: Tensor,
    repetition_penalty: Tensor | float = 1.0,
    frequency_penalty: Tensor | float = 0.0,
    presence_penalty: Tensor | float = 0.0,
) -> Tensor:
    """vLLM's penalties (vllm/model_executor/layers/utils.py apply_penalties), per row:
    - repetition_penalty r (> 0; 1 is off), over every token seen in the prompt or the output so
      far: a positive logit is divided by r, a negative one multiplied by r (CTRL's form);
    - frequency_penalty f and presence_penalty p (OpenAI's definition), over output tokens only:
      logit -= f * count + p * (count > 0).
    logits [B, V]; prompt_mask [B, V] bool (the token occurs in the prompt); output_counts [B, V]
    (how often it was generated); the penalties scalars or [B]. Returns new fp32 logits."""
    logits = logits.float()
    B = logits.shape[0]
    device = logits.device
    rep = torch.as_tensor(repetition_penalty, dtype=torch.float32, device=device).expand(B).unsqueeze(-1)
    freq = torch.as_tensor(frequency_penalty, dtype=torch.float32, device=device).expand(B).unsqueeze(-1)
    pres = torch.as_tensor(presence_penalty, dtype=torch.float32, device=device).expand(B).unsqueeze(-1)
    counts = output_counts.float()
    seen_out = output_counts > 0
    factor = torch.where(prompt_mask | seen_out, rep, torch.ones_like(rep))
    logits = torch.where(logits > 0, logits / factor, logits * factor)
    return logits - freq * counts - pres * seen_out.float()


def apply_min_tokens(logits: Tensor, stop_mask: Tensor, generated: Tensor, min_tokens: Tensor) -> Tensor:
    """vLLM's min_tokens (its MinTokensLogitsProcessor): while a row has generated fewer than
    min_tokens tokens, its stop tokens (EOS unless ignore_eos, and stop_token_ids; `stop_mask`
    [B, V] bool) cannot be drawn. generated, min_tokens [B] int."""
    active = (generated < min_tokens).unsqueeze(-1)
    return logits.masked_fill(stop_mask & active, float("-inf"))


def sampling_probs(
    logits: Tensor, temperature: Tensor | float = 1.0, top_p: Tensor | float = 1.0, top_k: Tensor | int = 0
) -> tuple[Tensor, Tensor]:
    """(scaled logits, the mask of tokens that may be drawn) of one draw at temperature > 0:
    logits / temperature, restricted to the top_k largest (0 or less: all; ties with the k-th are
    kept, as vLLM's `logits < kth` mask keeps them), then to the top-p nucleus of the softmax over
    that set as vLLM computes it (the most likely token always stays), kept as a probability
    threshold so ties at the edge are all in or all out. The distribution drawn from is
    softmax(scaled) over the mask."""
    logits = logits.float()
    B, V = logits.shape
    device = logits.device
    temperature = torch.as_tensor(temperature, dtype=torch.float32, device=device).expand(B)
    top_p = torch.as_tensor(top_p, dtype=torch.float32, device=device).expand(B)
    top_k = torch.as_tensor(top_k, dtype=torch.int64, device=device).expand(B)
    scaled = logits / temperature.clamp(min=1e-6).unsqueeze(-1)
    ordered = scaled.sort(dim=-1, descending=True).values
    k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V))
    kth = ordered.gather(1, (k - 1).unsqueeze(-1))
    in_top_k = scaled >= kth
    # vLLM's nucleus, in its rounding: ascending, drop the prefix whose cumulative mass is <= 1 - top_p
    # (the largest always stays). Kept as the smallest logit that stays (compared as logits, not as
    # probabilities recomputed in another order), so ties at the edge are all in or all out.
    masked = ordered.masked_fill(ordered < kth, float("-inf")).flip(-1)
    not_largest = torch.arange(V, device=device) < V - 1
    drop = (torch.softmax(masked, dim=-1).cumsum(-1) <= (1 - top_p).unsqueeze(-1)) & not_largest
    threshold = masked.masked_fill(drop, float("inf")).amin(-1, keepdim=True)
    return scaled, in_top_k & (scaled >= threshold)


def sample_next(
    logits: Tensor,
    temperature: Tensor | float = 0.0,
    top_p: Tensor | float = 1.0,
    keys: Tensor | int = 0,
    top_k: Tensor | int = 0,
) -> Tensor:
    """Next token per row of logits [B, V]: greedy where temperature == 0, else a draw from
    `sampling_probs` (temperature, top-k, top-p) by the Gumbel-max trick with the counter-based
    `uniforms` of the row's key (`stream_key(seed, token index)`). No host synchronisation and no
    data-dependent shapes: the same code runs eagerly (laplace generate, the prefill's first token)
    and inside the engine's compiled decode step. Per row: temperature, top_p [B] float; keys,
    top_k [B] int64. Penalties and min_tokens are applied to `logits` before (apply_penalties,
    apply_min_tokens)."""
    logits = logits.float()
    B, V = logits.shape
    device = logits.device
    temperature = torch.as_tensor(temperature, dtype=torch.float32, device=device).expand(B)
    keys = torch.as_tensor(keys, dtype=torch.int64, device=device).expand(B)
    greedy = logits.argmax(-1)
    scaled, allowed = sampling_probs(logits, temperature, top_p, top_k)
    gumbel = -torch.log(-torch.log(uniforms(keys, V)))
    scores = torch.where(allowed, scaled + gumbel, float("-inf"))
    return torch.where(temperature > 0, scores.argmax(-1), greedy)


def logprobs_of(logits: Tensor, tokens: Tensor, top_n: int) -> tuple[Tensor, Tensor, Tensor]:
    """What OpenAI's `logprobs` reports for one position per row, from the model's raw logits (as
    vLLM's default `raw_logprobs`, before penalties and temperature): (the chosen token's log-prob
    [B], the top_n log-probs [B, top_n], their token ids [B, top_n])."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, tokens.long().unsqueeze(-1)).squeeze(-1)
    top = logp.topk(max(top_n, 1), dim=-1)
    return chosen, top.values[:, :top_n], top.indices[:, :top_n]
