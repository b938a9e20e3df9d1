"""Gated Linear Attention: the same recurrence in three forms.

    S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t        o_t = (scale * q_t) S_t

Shapes follow flash-linear-attention: q, k, g are [B, T, H, K], v is [B, T, H, V],
the state S is [B, H, K, V]. `g` is the per-channel log forget gate (<= 0).

- `naive_gla`: token by token, the reference the tests trust.
- `chunk_gla`: training and prefill; exact down to a per-token decay of e^-10 (see
  `_intra_chunk_scores`), which it clamps its gate at, for |q * scale| and |k| below
  ~6e3 (see `chunk_gla`).
- `gla_step`: one decode token on an explicit state.

All three run in plain PyTorch operators (no device kernels), accumulate gates
and state in fp32 (fp64 when given fp64) whatever the autocast context, and
trace into one static graph under torch.compile(fullgraph=True, dynamic=False).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor


def accum_dtype(*tensors: Tensor) -> torch.dtype:
    """fp32 for every low-precision input, fp64 when any input is fp64 (the reference)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _no_autocast(t: Tensor):
    # The recurrence must not be down-cast by an enclosing autocast region.
    if torch.is_autocast_enabled(t.device.type):
        return torch.autocast(device_type=t.device.type, enabled=False)
    return contextlib.nullcontext()


def naive_gla(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Reference recurrence, one token at a time. Returns (o [B,T,H,V] in v's dtype, final state)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    dt = accum_dtype(q, k, v, g)
    with _no_autocast(q):
        q, k, v, g = (x.to(dt) for x in (q, k, v, g))
        S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dt)
        outs = []
        for t in range(T):
            S = S * g[:, t].exp().unsqueeze(-1) + k[:, t].unsqueeze(-1) * v[:, t].unsqueeze(-2)
            outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, S))
        o = torch.stack(outs, dim=1) if outs else v.new_zeros(B, 0, H, V)
    return o.to(v.dtype), S


def gla_step(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, state: Tensor, scale: float | None = None
) -> tuple[Tensor, Tensor]:
    """One decode token: q, k, g [B,H,K], v [B,H,V], state [B,H,K,V] -> (o [B,H,V], new state)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dt = state.dtype
    with _no_autocast(q):
        q, k, v, g = (x.to(dt) for x in (q, k, v, g))
        state = state * g.exp().unsqueeze(-1) + k.unsqueeze(-1) * v.unsqueeze(-2)
        o = torch.einsum("bhk,bhkv->bhv", q * scale, state)
    return o, state


EXP_BUDGET = 80.0  # largest exponent the sub-chunk factorisation may need (fp32 exp overflows past 88.7)


def min_log_decay(sub_chunk_size: int) -> float:
    """The per-token log decay floor under which `chunk_gla` stays exact.

    Inside a sub-chunk the factors span at most sub/2 tokens, so a floor of
    -EXP_BUDGET / (sub/2) keeps every exponent within EXP_BUDGET: -10 at sub 16, a
    retention of 4.5e-5 per token (the gate logit would have to be below -160).
    """
    return -EXP_BUDGET / max(sub_chunk_size // 2, 1)


def _sub_chunk_cumsums(g: Tensor, sub: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Log-decay sums inside chunks, cut into sub-chunks of `sub` tokens.

    g: [..., C, K] -> (local [.., M, sub, K] inclusive cumsum inside each sub-chunk,
    total [.., M, K] per sub-chunk, before [.., M, K] from the chunk start to each
    sub-chunk's start, after [.., M, K] from each sub-chunk's end to the chunk end).
    Keeping sums local means a small decay is never the difference of two large ones.
    """
    *lead, C, K = g.shape
    local = g.reshape(*lead, C // sub, sub, K).cumsum(-2)
    total = local[..., -1, :]
    before = total.cumsum(-2) - total
    after = total.flip(-2).cumsum(-2).flip(-2) - total
    return local, total, before, after


def _intra_chunk_scores(q: Tensor, k: Tensor, local: Tensor, total: Tensor, before: Tensor) -> Tensor:
    """Decayed causal scores A[i, j] = sum_c q_ic k_jc exp(b_ic - b_jc) (j <= i) inside each chunk.

    q, k: [..., C, K]; the decay sums come from `_sub_chunk_cumsums`. Returns A [..., C, C].

    The textbook factorisation q*exp(b) @ (k*exp(-b))^T overflows once the in-chunk
    cumulative decay passes -88 (fp32). Here pairs across sub-chunks are factored through
    the sub-chunk boundaries (every exponent <= 0), and pairs inside a sub-chunk through
    its middle token, so no exponent exceeds half a sub-chunk's decay: exact while every
    g >= min_log_decay(sub) (the GLA layer clamps its gate there). Everything is a
    matmul or a cheap elementwise op on q/k-sized tensors; an earlier version built
    [sub, sub, K] pairwise decays and was 3.3x slower at 8,192 tokens.
    """
    *lead, C, K = q.shape
    M, sub = local.shape[-3], local.shape[-2]
    qs, ks = q.reshape(*lead, M, sub, K), k.reshape(*lead, M, sub, K)

    # Pairs inside one sub-chunk, factored through the sub-chunk's middle token r:
    # exp(l_i - l_j) = exp(l_i - l_r) * exp(l_r - l_j); each exponent spans at most half a sub-chunk.
    mid = local[..., sub // 2 - 1 : sub // 2, :] if sub > 1 else local
    qm = qs * (local - mid).exp()
    km = ks * (mid - local).exp()
    causal = torch.ones(sub, sub, dtype=torch.bool, device=q.device).tril()
    A_diag = torch.where(causal, qm @ km.transpose(-1, -2), 0.0)  # [.., M, sub, sub]

    # Pairs across sub-chunks m' < m: exp(b_i - b_j) = exp(local_i) * exp(gap) * exp(total_m' - local_j),
    # gap = the decay between the end of m' and the start of m.
    q_hat = qs * local.exp()
    k_hat = ks * (total.unsqueeze(-2) - local).exp()
    gap = before.unsqueeze(-2) - (before + total).unsqueeze(-3)  # [.., m, m', K]
    lower = torch.ones(M, M, dtype=torch.bool, device=q.device).tril(-1)
    gap = gap.masked_fill(~lower.unsqueeze(-1), float("-inf")).exp()
    A_off = (q_hat.unsqueeze(-3) * gap.unsqueeze(-2)) @ k_hat.unsqueeze(-4).transpose(-1, -2)  # [.., m, m', i, j]

    eye = torch.eye(M, dtype=torch.bool, device=q.device)[:, :, None, None]
    blocks = torch.where(eye, A_diag.unsqueeze(-3), A_off)  # [.., M, M, sub, sub]
    return blocks.transpose(-3, -2).reshape(*lead, C, C)


def chunk_gla(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    lengths: Tensor | None = None,
    chunk_size: int = 64,
    sub_chunk_size: int = 16,
    segment_len: int = 2048,
) -> tuple[Tensor, Tensor]:
    """Chunk-parallel GLA. Returns (o [B,T,H,V] in v's dtype, final state [B,H,K,V] in fp32/fp64).

    `lengths` [B] marks right padding: positions >= lengths[b] are exact no-ops for
    the state (their k, v and g are zeroed with `where`, so NaN padding cannot leak).
    T need not be a multiple of the chunk size.

    Domain: the sub-chunk factorisation multiplies q and k by factors up to e^EXP_BUDGET
    (e^80) when decays sit at the floor, so it is exact for g >= min_log_decay(sub_chunk_size)
    and |q * scale|, |k| < 3.4e38 / e^80 ~ 6.1e3 (fp32; activations of a normed model are
    orders of magnitude smaller). Below the floor g is clamped to it, so the op never returns
    NaN for a strong decay: it then computes the recurrence of the clamped gate (a retention of
    4.5e-5 per token at sub-chunk 16), which is what the GLA layer feeds every form anyway.

    Gradients: those of q, k and v match the fp64 naive form to ~1e-7. The gate's gradient is a
    difference of query-side and key-side sums (as in fla's dg = revcumsum(q*dq - k*dk)), whose
    absolute error stays ~1e-6 of the q*dq scale; under strong decays the true gate gradient
    shrinks, so its relative error grows: ~2e-6 at g in [-3, -0.75], ~2e-4 at [-10, -5]
    (tests/test_gla.py states both bounds).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    C = chunk_size
    sub = min(sub_chunk_size, C)
    dt = accum_dtype(q, k, v, g)
    out_dtype = v.dtype
    with _no_autocast(q):
        q, k, v, g = (x.to(dt).transpose(1, 2) for x in (q, k, v, g))  # [B, H, T, *]
        if lengths is not None:
            real = (torch.arange(T, device=q.device) < lengths.unsqueeze(-1))[:, None, :, None]
            k = torch.where(real, k, 0.0)
            v = torch.where(real, v, 0.0)
            g = torch.where(real, g, 0.0)
        g = g.clamp_min(min_log_decay(sub))  # the floor of exactness; NaN padding was zeroed above
        S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dt)
        # Long sequences run in cache-sized segments carrying the state (the same math):
        # one pass over 8,192 tokens spills the last-level cache and costs 5x 2,048, not 4x.
        seg = max(C, segment_len // C * C)
        outs = []
        for start in range(0, T, seg):
            end = min(start + seg, T)
            o, S = _chunk_segment(
                q[:, :, start:end] * scale, k[:, :, start:end], v[:, :, start:end], g[:, :, start:end], S, C, sub
            )
            outs.append(o)
        o = (torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]).transpose(1, 2)
    return o.to(out_dtype), S


def _chunk_segment(q: Tensor, k: Tensor, v: Tensor, g: Tensor, S: Tensor, C: int, sub: int):
    """One segment [B, H, T, *] (q already scaled) from state S -> (o [B, H, T, V], final state)."""
    B, H, T, K = q.shape
    V = v.shape[-1]
    pad = (-T) % C
    if pad:  # zero k, v and g: padded tokens leave the state alone
        q, k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
    N = (T + pad) // C
    q = q.reshape(B, H, N, C, K)
    k = k.reshape(B, H, N, C, K)
    v = v.reshape(B, H, N, C, V)
    g = g.reshape(B, H, N, C, K)

    local, total, before, after = _sub_chunk_cumsums(g, sub)
    A = _intra_chunk_scores(q, k, local, total, before)  # [B,H,N,C,C]
    b = (before.unsqueeze(-2) + local).reshape(B, H, N, C, K)  # chunk start -> token (inclusive)
    to_end = ((after + total).unsqueeze(-2) - local).reshape(B, H, N, C, K)  # token (exclusive) -> chunk end
    # State carried across chunks: S_{n+1} = exp(b_last) S_n + (k exp(to_end))^T v.
    delta = (k * to_end.exp()).transpose(-1, -2) @ v  # [B,H,N,K,V]
    decay = (before[..., -1, :] + total[..., -1, :]).exp().unsqueeze(-1)  # [B,H,N,K,1]
    starts = []
    # unbind, not indexing: the backward of N selects would zero-fill N full-size grads
    for decay_n, delta_n in zip(decay.unbind(2), delta.unbind(2)):
        starts.append(S)
        S = decay_n * S + delta_n
    S_start = torch.stack(starts, dim=2)  # [B,H,N,K,V]
    o = (q * b.exp()) @ S_start + A @ v  # [B,H,N,C,V]
    return o.reshape(B, H, N * C, V)[:, :, :T], S
