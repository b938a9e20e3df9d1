"""Softmax attention layers of hybrid and softmax models, as fla 0.6's `fla.layers.attn.Attention`
computes them, in plain PyTorch (CPU, CUDA and Neuron alike).

fla's layer: q/k/v projections (bias when qkv_bias), grouped key/value heads (query head h reads
kv head h // (H / H_kv), flash-attn's rule), RoPE on q and k by `fla.modules.RotaryEmbedding`
(non-interleaved halves, inverse frequencies 1 / theta^(2i/d) in fp32, positions in fp32, cos and
sin cast to the activation dtype, the rotation itself in fp32), causal softmax attention scaled by
1/sqrt(head dim), optionally over a sliding window of `window_size` keys (the query's own position
included: flash-attn's window (w-1, 0)), and an o projection without bias. fla's Attention refuses
to construct without flash-attn; this one is `scaled_dot_product_attention`, with flash-attn as an
optional fast path of the training forward on CUDA (the torch form is the reference).

Decoding keeps each layer's K/V in a static-shape cache [rows, max_context, H_kv, head dim] (the
State's `keys` / `values`, gpt-fast's KVCache, viewed per layer by `cache_view`): keys are cached
after RoPE, written in place at each row's position, and every call attends over the whole buffer
under a mask, so the compiled graphs never change shape with the context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from laplace.model.config import ModelConfig
from laplace.model.gla import accum_dtype


def rope_inv_freq(head_dim: int, theta: float, device=None) -> Tensor:
    """fla's RotaryEmbedding._compute_inv_freq: 1 / theta^(arange(0, d, 2) / d), in fp32."""
    return 1.0 / (float(theta) ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))


def apply_rope(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """x [B, T, H, D] rotated at `positions` [B, T] as fla's rotary kernel does: the angle
    position * inv_freq in fp32, cos / sin cast to x's dtype, then (x0 cos - x1 sin, x0 sin + x1 cos)
    over the two halves in fp32 (fp64 for an fp64 model), cast back to x's dtype."""
    head_dim = x.shape[-1]
    angles = positions.to(torch.float32).unsqueeze(-1) * rope_inv_freq(head_dim, theta, x.device)  # [B, T, D/2]
    work = accum_dtype(x)
    cos = angles.cos().to(x.dtype).to(work).unsqueeze(2)  # [B, T, 1, D/2]
    sin = angles.sin().to(x.dtype).to(work).unsqueeze(2)
    x0, x1 = x.to(work).chunk(2, dim=-1)
    return torch.cat([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).to(x.dtype)


def attention_mask(q_pos: Tensor, k_pos: Tensor, window: int | None) -> Tensor:
    """Which keys each query sees: [B, Tq, Tk] bool from query positions [B, Tq] and key
    positions [Tk] (causal; within `window` keys, the query's own included, when set)."""
    q, k = q_pos.unsqueeze(-1), k_pos.view(1, 1, -1)
    mask = k <= q
    if window is not None:
        mask = mask & (k > q - window)
    return mask


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool = False) -> Tensor:
    """q [B, Tq, H, D], k/v [B, Tk, Hkv, D] -> [B, Tq, H, D]; kv heads repeated for their query
    groups (head h reads kv head h // groups) so every backend, Neuron's included, sees plain MHA."""
    groups = q.shape[2] // k.shape[2]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=2)
        v = v.repeat_interleave(groups, dim=2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=None if mask is None else mask.unsqueeze(1),
        is_causal=causal,
    )
    return out.transpose(1, 2)


def _flash_attn():
    """flash-attn's flash_attn_func where it is installed, else None."""
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        return None
    return flash_attn_func


class SoftmaxAttention(nn.Module):
    """One softmax attention layer (fla's Attention with qk_norm off), from its AttentionSpec."""

    def __init__(self, cfg: ModelConfig, spec: dict):
        super().__init__()
        D = cfg.d_model
        self.n_heads, self.n_kv_heads = spec["num_heads"], spec["num_kv_heads"]
        self.head_dim = D // self.n_heads
        self.window = spec["window_size"]
        self.rope_theta = float(spec["rope_theta"])
        bias = spec["qkv_bias"]
        self.q_proj = nn.Linear(D, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(D, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(D, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, D, bias=False)

    def cache_view(self, buffer: Tensor) -> Tensor:
        """This layer's K or V as [rows, max_context, H_kv, head dim]: a view of the first
        H_kv * head dim values of a State's [rows, max_context, W] layer slice (writes go through)."""
        width = self.n_kv_heads * self.head_dim
        return buffer[..., :width].view(*buffer.shape[:2], self.n_kv_heads, self.head_dim)

    def _qkv(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        B, T = x.shape[:2]
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        return apply_rope(q, positions, self.rope_theta), apply_rope(k, positions, self.rope_theta), v

    def _out(self, o: Tensor) -> Tensor:
        B, T = o.shape[:2]
        return self.o_proj(o.reshape(B, T, -1))

    def forward(self, x: Tensor) -> Tensor:
        """Training and the full forward: x [B, T, D] from position 0, no cache."""
        B, T = x.shape[:2]
        positions = torch.arange(T, device=x.device).expand(B, T)
        q, k, v = self._qkv(x, positions)
        flash = _flash_attn() if x.device.type == "cuda" and x.dtype in (torch.float16, torch.bfloat16) else None
        if flash is not None:  # the fast path; the torch form below is the reference
            window = (-1, -1) if self.window is None else (self.window - 1, 0)
            return self._out(flash(q, k, v, causal=True, window_size=window))
        if self.window is None:
            return self._out(_sdpa(q, k, v, None, causal=True))
        mask = attention_mask(positions, torch.arange(T, device=x.device), self.window)
        return self._out(_sdpa(q, k, v, mask))

    def prefill(
        self,
        x: Tensor,
        keys: Tensor,
        values: Tensor,
        rows: Tensor,
        start: Tensor,
        lengths: Tensor | None,
    ) -> Tensor:
        """x [B, T, D] (right-padded to `lengths`) continuing rows `rows` of the cache, whose
        sequences hold `start` [B] tokens so far. Writes the real tokens' K/V at positions
        start .. start+length-1 of those rows and attends over the whole buffer. A padded token
        writes nothing; its query is masked as the row's last real one (never an empty softmax)."""
        B, T = x.shape[:2]
        capacity = keys.shape[1]
        t = torch.arange(T, device=x.device)
        positions = start.view(B, 1) + t.view(1, T)  # [B, T]
        q, k, v = self._qkv(x, positions)
        real = torch.full((B,), T, device=x.device, dtype=torch.long) if lengths is None else lengths
        # the buffer rows with this call's tokens in place: position j takes token j - start where real
        j = torch.arange(capacity, device=x.device)
        offset = j.view(1, -1) - start.view(B, 1)  # [B, capacity]
        fresh = (offset >= 0) & (offset < real.view(B, 1))
        index = offset.clamp(0, T - 1).view(B, capacity, 1, 1).expand(-1, -1, self.n_kv_heads, self.head_dim)
        keep = fresh.view(B, capacity, 1, 1)
        new_k = torch.where(keep, k.gather(1, index).to(keys.dtype), keys.index_select(0, rows))
        new_v = torch.where(keep, v.gather(1, index).to(values.dtype), values.index_select(0, rows))
        keys.index_copy_(0, rows, new_k)
        values.index_copy_(0, rows, new_v)
        last = (start + real - 1).clamp(min=0).view(B, 1)
        mask = attention_mask(torch.minimum(positions, last), j, self.window)
        return self._out(_sdpa(q, new_k.to(q.dtype), new_v.to(q.dtype), mask))

    def step(self, x: Tensor, keys: Tensor, values: Tensor, rows: Tensor, position: Tensor) -> Tensor:
        """One token per row: x [B, 1, D] at `position` [B] of cache rows `rows`; its K/V are
        written in place there (a position past the buffer, only ever the dummy row's, writes and
        reads its last entry), then it attends over the row's buffer."""
        capacity = keys.shape[1]
        q, k, v = self._qkv(x, position.view(-1, 1))
        at = position.clamp(max=capacity - 1)
        keys.index_put_((rows, at), k[:, 0].to(keys.dtype))
        values.index_put_((rows, at), v[:, 0].to(values.dtype))
        j = torch.arange(capacity, device=x.device)
        mask = attention_mask(at.view(-1, 1), j, self.window)
        k_rows, v_rows = keys.index_select(0, rows), values.index_select(0, rows)
        return self._out(_sdpa(q, k_rows.to(q.dtype), v_rows.to(q.dtype), mask))
