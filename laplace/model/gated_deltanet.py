"""Gated DeltaNet (Yang, Kautz & Hatamizadeh, arXiv 2412.06464): the gated delta rule in three forms.

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T        o_t = S_t^T (scale * q_t)

Written as fla's naive form does it: decay the state, read the value it already holds for k_t,
write back beta_t times the difference (the delta rule). Shapes follow flash-linear-attention:
q, k [B, T, H, K] (L2-normalised by the layer), v [B, T, HV, V], g (log decay <= 0) and beta
(in (0, 1)) [B, T, HV], the state [B, HV, K, V]. GVA: with HV > H value heads, value head h reads
query/key head h // (HV / H), as fla's kernels map them.

- `naive_gated_delta_rule`: token by token, the reference the tests trust (fp32 or fp64).
- `chunk_gated_delta_rule`: training and prefill, the WY / UT-transform algorithm (the paper's
  section 3, fla's chunk.py) in plain PyTorch operators; traces into one static graph under
  torch.compile(fullgraph=True, dynamic=False).
- `gated_delta_step`: one decode token on an explicit state.

All three accumulate in fp32 (fp64 when given fp64) whatever the autocast context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from laplace.model.gla import _no_autocast, accum_dtype


def expand_heads(x: Tensor, value_heads: int) -> Tensor:
    """q or k [B, T, H, K] -> [B, T, HV, K]: each query/key head repeated for its HV/H value heads."""
    H = x.shape[-2]
    return x if H == value_heads else x.repeat_interleave(value_heads // H, dim=-2)


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum x^2 + eps) over the last dimension, fla's l2norm (eps inside the root)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def naive_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Reference recurrence, one token at a time. Returns (o [B,T,HV,V] in v's dtype, final state)."""
    B, T, HV, V = v.shape
    K = q.shape[-1]
    scale = K**-0.5 if scale is None else scale
    dt = accum_dtype(q, k, v, g, beta)
    with _no_autocast(q):
        q, k = (expand_heads(x, HV).to(dt) for x in (q, k))
        v, g, beta = (x.to(dt) for x in (v, g, beta))
        S = q.new_zeros(B, HV, K, V) if initial_state is None else initial_state.to(dt)
        outs = []
        for t in range(T):
            S = S * g[:, t].exp()[..., None, None]
            held = torch.einsum("bhk,bhkv->bhv", k[:, t], S)  # what the state returns for k_t now
            delta = beta[:, t, :, None] * (v[:, t] - held)
            S = S + k[:, t].unsqueeze(-1) * delta.unsqueeze(-2)
            outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, S))
        o = torch.stack(outs, dim=1) if outs else v.new_zeros(B, 0, HV, V)
    return o.to(v.dtype), S


def gated_delta_step(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, scale: float | None = None
) -> tuple[Tensor, Tensor]:
    """One decode token: q, k [B,H,K], v [B,HV,V], g, beta [B,HV], state [B,HV,K,V]
    -> (o [B,HV,V] in the state's dtype, new state)."""
    HV = v.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dt = state.dtype
    with _no_autocast(q):
        q, k = (expand_heads(x.unsqueeze(1), HV)[:, 0].to(dt) for x in (q, k))
        v, g, beta = (x.to(dt) for x in (v, g, beta))
        state = state * g.exp()[..., None, None]
        delta = beta.unsqueeze(-1) * (v - torch.einsum("bhk,bhkv->bhv", k, state))
        state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
        o = torch.einsum("bhk,bhkv->bhv", q * scale, state)
    return o, state


def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    lengths: Tensor | None = None,
    chunk_size: int = 64,
    segment_len: int = 2048,
) -> tuple[Tensor, Tensor]:
    """Chunk-parallel gated delta rule. Returns (o [B,T,HV,V] in v's dtype, final state [B,HV,K,V]
    in fp32/fp64).

    `lengths` [B] marks right padding: positions >= lengths[b] are exact no-ops for the state
    (k, v, g and beta zeroed with `where`, so NaN padding cannot leak: beta = 0 writes nothing,
    g = 0 decays nothing). T need not be a multiple of the chunk size.

    Every exponent is a difference b_i - b_j (j <= i) of in-chunk cumulative log decays, so <= 0:
    no overflow for any decay, no clamp (unlike chunk_gla's per-channel gate, the gate here is one
    scalar per head and token, and the [C, C] decay matrix is formed directly).
    """
    B, T, HV, V = v.shape
    K = q.shape[-1]
    scale = K**-0.5 if scale is None else scale
    dt = accum_dtype(q, k, v, g, beta)
    out_dtype = v.dtype
    with _no_autocast(q):
        q, k = (expand_heads(x, HV).to(dt).transpose(1, 2) for x in (q, k))  # [B, HV, T, K]
        v = v.to(dt).transpose(1, 2)
        g, beta = (x.to(dt).transpose(1, 2) for x in (g, beta))  # [B, HV, T]
        if lengths is not None:
            real = torch.arange(T, device=q.device) < lengths.unsqueeze(-1)  # [B, T]
            k = torch.where(real[:, None, :, None], k, 0.0)
            v = torch.where(real[:, None, :, None], v, 0.0)
            g = torch.where(real[:, None, :], g, 0.0)
            beta = torch.where(real[:, None, :], beta, 0.0)
        S = q.new_zeros(B, HV, K, V) if initial_state is None else initial_state.to(dt)
        seg = max(chunk_size, segment_len // chunk_size * chunk_size)
        outs = []
        for start in range(0, T, seg):
            end = min(start + seg, T)
            o, S = _chunk_segment(
                q[:, :, start:end] * scale,
                k[:, :, start:end],
                v[:, :, start:end],
                g[:, :, start:end],
                beta[:, :, start:end],
                S,
                chunk_size,
            )
            outs.append(o)
        o = (torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]).transpose(1, 2)
    return o.to(out_dtype), S


def _chunk_segment(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S: Tensor, C: int):
    """One segment [B, HV, T, *] (q already scaled) from state S -> (o [B, HV, T, V], final state).

    Inside a chunk, with b_i the cumulative log decay from the chunk start to token i (inclusive),
    the values the delta rule writes are u_i = beta_i (v_i - exp(b_i) S_0^T k_i
    - sum_{j<i} exp(b_i - b_j) (k_i . k_j) u_j): a unit lower-triangular system (I + A) U =
    beta V - beta exp(b) K S_0. Its inverse T = (I + A)^-1 (the UT transform) depends on the chunk
    alone, so U = T beta V - (T beta exp(b) K) S_0 = U0 - W S_0: every chunk's T, U0 and W are
    computed at once, and only S_0 -> U -> S_C is carried chunk to chunk.
    """
    B, HV, T, K = q.shape
    V = v.shape[-1]
    pad = (-T) % C
    if pad:  # zero k, v, g and beta: padded tokens leave the state alone
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    N = (T + pad) // C
    q, k = (x.reshape(B, HV, N, C, K) for x in (q, k))
    v = v.reshape(B, HV, N, C, V)
    b = g.reshape(B, HV, N, C).cumsum(-1)
    beta = beta.reshape(B, HV, N, C, 1)

    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    # exp(b_i - b_j) for j <= i, 0 above the diagonal (masked before exp: no inf * 0)
    decay = torch.where(causal, b.unsqueeze(-1) - b.unsqueeze(-2), float("-inf")).exp()  # [B,HV,N,C,C]
    strict = torch.where(causal.logical_not().T, (beta * k) @ k.transpose(-1, -2) * decay, 0.0)  # j < i
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    rhs = torch.cat([beta * v, beta * b.exp().unsqueeze(-1) * k], dim=-1)  # [B,HV,N,C,V+K]
    solved = torch.linalg.solve_triangular(eye + strict, rhs, upper=False, unitriangular=True)
    U0, W = solved.split([V, K], dim=-1)

    scores = q @ k.transpose(-1, -2) * decay  # (q_i . k_j) exp(b_i - b_j), j <= i
    q_decayed = q * b.exp().unsqueeze(-1)
    b_last = b[..., -1:]  # [B,HV,N,1]
    k_to_end = k * (b_last - b).exp().unsqueeze(-1)  # k_j exp(b_C - b_j)
    outs = []
    # unbind, not indexing: the backward of N selects would zero-fill N full-size grads
    for U0_n, W_n, qd_n, sc_n, kd_n, bl_n in zip(
        U0.unbind(2), W.unbind(2), q_decayed.unbind(2), scores.unbind(2), k_to_end.unbind(2), b_last.unbind(2)
    ):
        U = U0_n - W_n @ S
        outs.append(qd_n @ S + sc_n @ U)
        S = bl_n.exp().unsqueeze(-1) * S + kd_n.transpose(-1, -2) @ U
    o = torch.stack(outs, dim=2)  # [B,HV,N,C,V]
    return o.reshape(B, HV, N * C, V)[:, :, :T], S
