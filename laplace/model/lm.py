"""The GLA language model: embeddings, pre-norm blocks (GLA + SwiGLU), head, and its State.

Three entry points share the weights:
- `forward(tokens)`: training, chunked GLA from a zero state.
- `prefill(tokens, state, ...)`: chunked GLA from (and into) a decode state.
- `decode_step(tokens, state, ...)`: one token per row through the recurrent form.

The State is allocated once with a fixed shape (like gpt-fast's KVCache) and
updated in place; `slots` pick which rows of it a call reads and writes, so a
serving pool and a compiled fixed-width decode graph share one object.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from laplace.model import kernels
from laplace.model.config import ModelConfig
from laplace.model.gla import accum_dtype
from laplace.sharding import local_rows

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def torch_dtype(name: str) -> torch.dtype:
    return DTYPES[name]


# --------------------------------------------------------------------------- state


@dataclass
class State:
    """Fixed-size decode state of a batch of sequences, all layers.

    recurrent: [L, B, H, K/H, V/H] the GLA matrix state, always fp32 (fp64 for references).
    conv:      [L, B, conv_size-1, 2K+V] the last inputs of the short convolutions, in the
               activation dtype (None without short convolutions).
    """

    recurrent: Tensor
    conv: Tensor | None

    @classmethod
    def allocate(
        cls,
        cfg: ModelConfig,
        batch: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        state_dtype: torch.dtype | None = None,
    ) -> State:
        dtype = dtype or torch_dtype(cfg.dtype)
        state_dtype = state_dtype or (torch.float64 if dtype == torch.float64 else torch.float32)
        rec = torch.zeros(
            cfg.n_layers, batch, cfg.n_heads, cfg.head_k_dim, cfg.head_v_dim, device=device, dtype=state_dtype
        )
        conv = None
        if cfg.use_short_conv:
            width = 2 * cfg.key_dim + cfg.value_dim
            conv = torch.zeros(cfg.n_layers, batch, cfg.conv_size - 1, width, device=device, dtype=dtype)
        return cls(rec, conv)

    @property
    def batch_size(self) -> int:
        return self.recurrent.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes held by the live state tensors."""
        total = self.recurrent.numel() * self.recurrent.element_size()
        if self.conv is not None:
            total += self.conv.numel() * self.conv.element_size()
        return total

    @property
    def bytes_per_sequence(self) -> int:
        return self.nbytes // self.batch_size

    def zero_(self, rows: Tensor | None = None) -> State:
        for t in self._tensors():
            if rows is None:
                t.zero_()
            else:
                t.index_fill_(1, rows, 0)
        return self

    def select(self, rows: Tensor) -> State:
        """A copy of the given rows (a batch of sequences)."""
        conv = None if self.conv is None else self.conv.index_select(1, rows)
        return State(self.recurrent.index_select(1, rows), conv)

    def clone(self) -> State:
        return State(self.recurrent.clone(), None if self.conv is None else self.conv.clone())

    def _tensors(self):
        return [self.recurrent] + ([self.conv] if self.conv is not None else [])


def analytic_state_bytes(cfg: ModelConfig, dtype: torch.dtype | None = None) -> int:
    """The formula behind State.allocate, per sequence: L*H*(K/H)*(V/H)*4 + L*(conv-1)*(2K+V)*itemsize."""
    dtype = dtype or torch_dtype(cfg.dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    rec_itemsize = 8 if dtype == torch.float64 else 4
    total = cfg.n_layers * cfg.n_heads * cfg.head_k_dim * cfg.head_v_dim * rec_itemsize
    if cfg.use_short_conv:
        total += cfg.n_layers * (cfg.conv_size - 1) * (2 * cfg.key_dim + cfg.value_dim) * itemsize
    return total


def kv_cache_bytes(cfg: ModelConfig, tokens: int, bytes_per_value: int = 2) -> int:
    """K and V cache of a softmax transformer with the same layers and hidden size (no GQA)."""
    return 2 * cfg.n_layers * tokens * cfg.d_model * bytes_per_value


# --------------------------------------------------------------------------- initialisation

_INIT_BLOCK_VALUES = 1 << 16  # each block of rows draws from its own generator


def conv_init_bound(kernel_size: int) -> float:
    return 1.0 / math.sqrt(kernel_size)


def _block_seed(base: int, name: str, block: int) -> int:
    digest = hashlib.sha256(f"{base}/{name}/{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _seeded_fill_(p: Tensor, base: int, name: str, draw) -> None:
    """Fill `p` (or this rank's rows of it) with `draw(tensor, generator)`, drawn block of rows
    by block of rows, each block from a CPU generator seeded by (base, name, block index). A rank
    draws only the blocks its rows touch, so the values of a row do not depend on how the
    parameter is sharded, and nothing the size of the whole parameter is allocated."""
    local, first = local_rows(p)
    if local.numel() == 0:
        return
    per_row = math.prod(p.shape[1:])
    block_rows = max(1, _INIT_BLOCK_VALUES // max(1, per_row))
    lo, hi = first, first + local.shape[0]
    parts = []
    for block in range(lo // block_rows, (hi - 1) // block_rows + 1):
        b_lo, b_hi = block * block_rows, min((block + 1) * block_rows, p.shape[0])
        generator = torch.Generator().manual_seed(_block_seed(base, name, block))
        values = draw(torch.empty(b_hi - b_lo, *p.shape[1:]), generator)
        parts.append(values[max(lo, b_lo) - b_lo : min(hi, b_hi) - b_lo])
    local.copy_(torch.cat(parts))


# --------------------------------------------------------------------------- layers


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.to(y.dtype)).to(x.dtype)


class ShortConvolution(nn.Module):
    """Depthwise causal convolution + SiLU over [B, T, C], continuing from a cache of past inputs."""

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.kernel_size = kernel_size
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """nn.Conv1d's default: uniform in +-1/sqrt(fan_in), fan_in = kernel_size (depthwise)."""
        if not self.weight.is_meta:
            bound = conv_init_bound(self.kernel_size)
            local_rows(self.weight)[0].uniform_(-bound, bound)

    def forward(self, x: Tensor, cache: Tensor | None, lengths: Tensor | None = None) -> tuple[Tensor, Tensor]:
        B, T, C = x.shape
        K = self.kernel_size
        if cache is None:
            cache = x.new_zeros(B, K - 1, C)
        window = torch.cat([cache.to(x.dtype), x], dim=1)  # [B, K-1+T, C]
        y = F.conv1d(window.transpose(1, 2), self.weight.to(x.dtype), groups=C).transpose(1, 2)
        if lengths is None:
            new_cache = window[:, T:]
        else:  # the last K-1 real inputs: window positions lengths .. lengths+K-2
            idx = lengths.view(B, 1) + torch.arange(K - 1, device=x.device)
            new_cache = window.gather(1, idx.unsqueeze(-1).expand(B, K - 1, C))
        return F.silu(y), new_cache


class GatedLinearAttention(nn.Module):
    """GLA layer (fla conventions): q/k/v/output-gate projections, low-rank forget gate
    through logsigmoid / normaliser, optional short convolutions, per-head RMSNorm and
    a swish output gate."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        D, K, V, r = cfg.d_model, cfg.key_dim, cfg.value_dim, cfg.gate_low_rank_dim
        self.n_heads, self.head_k_dim, self.head_v_dim = cfg.n_heads, cfg.head_k_dim, cfg.head_v_dim
        self.q_proj = nn.Linear(D, K, bias=False)
        self.k_proj = nn.Linear(D, K, bias=False)
        self.v_proj = nn.Linear(D, V, bias=False)
        self.g_proj = nn.Linear(D, V, bias=False)
        self.gk_proj = nn.Sequential(nn.Linear(D, r, bias=False), nn.Linear(r, K, bias=True))
        if cfg.use_short_conv:
            self.q_conv = ShortConvolution(K, cfg.conv_size)
            self.k_conv = ShortConvolution(K, cfg.conv_size)
            self.v_conv = ShortConvolution(V, cfg.conv_size)
        self.g_norm = RMSNorm(self.head_v_dim, cfg.norm_eps)
        self.o_proj = nn.Linear(V, D, bias=False)

    def _qkvg(self, x: Tensor, conv: Tensor | None, lengths: Tensor | None):
        cfg = self.cfg
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        new_conv = None
        if cfg.use_short_conv:
            K = cfg.key_dim
            cq, ck, cv = (None, None, None) if conv is None else conv.split([K, K, cfg.value_dim], dim=-1)
            q, cq = self.q_conv(q, cq, lengths)
            k, ck = self.k_conv(k, ck, lengths)
            v, cv = self.v_conv(v, cv, lengths)
            new_conv = torch.cat([cq, ck, cv], dim=-1)
        # gate math in fp32 for fp32/bf16 models, in fp64 for the fp64 reference
        gk = F.logsigmoid(self.gk_proj(x).to(accum_dtype(x))) / cfg.gate_logit_normalizer
        # The model's own clamp (fla's clamp_min, None: none). The kernels also floor the gate at
        # min_log_decay(sub_chunk_size) (-10 at sub-chunk 16, a retention of 4.5e-5 per token), where
        # the torch chunked form is exact, so every form sees the same gate.
        if cfg.gate_clamp_min is not None:
            gk = gk.clamp_min(cfg.gate_clamp_min)
        B, T = x.shape[:2]
        H = self.n_heads
        q = q.view(B, T, H, self.head_k_dim)
        k = k.view(B, T, H, self.head_k_dim)
        v = v.view(B, T, H, self.head_v_dim)
        gk = gk.view(B, T, H, self.head_k_dim)
        return q, k, v, gk, new_conv

    def _output(self, x: Tensor, o: Tensor) -> Tensor:
        B, T = x.shape[:2]
        gate = self.g_proj(x).view(B, T, self.n_heads, self.head_v_dim)
        o = self.g_norm(o.to(x.dtype)) * F.silu(gate)
        return self.o_proj(o.reshape(B, T, -1))

    def forward(
        self,
        x: Tensor,
        recurrent: Tensor | None = None,
        conv: Tensor | None = None,
        lengths: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Chunked form over [B, T, D]. Returns (y, final recurrent state, conv cache)."""
        q, k, v, gk, new_conv = self._qkvg(x, conv, lengths)
        o, S = kernels.chunk(
            self._kernel(x),
            q,
            k,
            v,
            gk,
            initial_state=recurrent,
            lengths=lengths,
            chunk_size=self.cfg.chunk_size,
            sub_chunk_size=self.cfg.sub_chunk_size,
            segment_len=self.cfg.segment_len,
        )
        return self._output(x, o), S, new_conv

    def step(self, x: Tensor, recurrent: Tensor, conv: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
        """Recurrent form for one token per row: x [B, 1, D]."""
        q, k, v, gk, new_conv = self._qkvg(x, conv, None)
        o, S = kernels.step(
            self._kernel(x), q[:, 0], k[:, 0], v[:, 0], gk[:, 0], recurrent, sub_chunk_size=self.cfg.sub_chunk_size
        )
        return self._output(x, o.unsqueeze(1)), S, new_conv

    def _kernel(self, x: Tensor) -> str:
        """model.kernel resolved for where this call runs (constants only: free inside a traced graph)."""
        return kernels.resolve_kernel(self.cfg.kernel, x.device, x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, hidden, bias=False)
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = GatedLinearAttention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.ffn_dim)

    def forward(self, x, recurrent=None, conv=None, lengths=None, step: bool = False):
        h = self.attn_norm(x)
        if step:
            a, S, c = self.attn.step(h, recurrent, conv)
        else:
            a, S, c = self.attn(h, recurrent, conv, lengths)
        x = x + a
        x = x + self.mlp(self.mlp_norm(x))
        return x, S, c


# --------------------------------------------------------------------------- model


class LaplaceLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # Drawn first, on the CPU even under `with torch.device("meta")`: after the same
        # torch.manual_seed, a model built whole and one built on meta and sharded get the
        # same weights from reset_parameters.
        self.init_seed = int(torch.randint(0, 2**62, (), device="cpu"))
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise every parameter in place, on whatever device it lives and however it is
        sharded: the values depend only on `init_seed` (drawn at construction, so decided by
        torch.manual_seed) and the parameter's name, never on the world size, so a model
        sharded by FSDP2 over N ranks starts from exactly the weights a single process would
        (see `_seeded_fill_`). Calling it again restores the same initial weights."""
        params = list(self.named_parameters())
        if any(p.is_meta for _, p in params):
            return  # built on meta: materialise with to_empty(device), then call this again
        cfg, base = self.cfg, self.init_seed
        residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)  # GPT-2 style: shrink with depth
        for name, p in params:
            if name.endswith("conv.weight"):
                bound = conv_init_bound(p.shape[-1])
                _seeded_fill_(p, base, name, lambda t, g, b=bound: t.uniform_(-b, b, generator=g))
            elif p.ndim >= 2:
                std = residual_std if name.endswith(("attn.o_proj.weight", "mlp.down_proj.weight")) else cfg.init_std
                _seeded_fill_(p, base, name, lambda t, g, s=std: t.normal_(0.0, s, generator=g))
            elif name.endswith("norm.weight"):
                local_rows(p)[0].fill_(1.0)
            elif name.endswith("gk_proj.1.bias"):
                local_rows(p)[0].fill_(cfg.gate_bias_init)
            else:
                local_rows(p)[0].zero_()

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def _logits(self, x: Tensor) -> Tensor:
        return self.lm_head(self.norm(x))

    def forward(self, tokens: Tensor) -> Tensor:
        """Training: tokens [B, T] -> logits [B, T, vocab]."""
        x = self.embed(tokens)
        for block in self.blocks:
            x, _, _ = block(x)
        return self._logits(x)

    def prefill(
        self,
        tokens: Tensor,
        state: State,
        slots: Tensor | None = None,
        lengths: Tensor | None = None,
        all_logits: bool = False,
    ) -> Tensor:
        """Run prompts [B, T] (right-padded to `lengths`) through the chunked form, continuing
        from the state rows `slots` (all rows if None) and writing them back.
        Returns the logits at each row's last real token [B, vocab] (or all [B, T, vocab])."""
        x = self.embed(tokens)
        rec, conv = self._read(state, slots)
        new_rec, new_conv = [], []
        for i, block in enumerate(self.blocks):
            x, S, c = block(x, rec[i], None if conv is None else conv[i], lengths)
            new_rec.append(S)
            new_conv.append(c)
        self._write(state, slots, new_rec, new_conv)
        if all_logits:
            return self._logits(x)
        if lengths is None:
            last = x[:, -1]
        else:
            last = x.gather(1, (lengths - 1).clamp(min=0).view(-1, 1, 1).expand(-1, 1, x.shape[-1])).squeeze(1)
        return self._logits(last)

    def decode_step(self, tokens: Tensor, state: State, slots: Tensor | None = None) -> Tensor:
        """One token per row: tokens [B] -> logits [B, vocab]; reads and writes state rows `slots`."""
        x = self.embed(tokens).unsqueeze(1)
        rec, conv = self._read(state, slots)
        new_rec, new_conv = [], []
        for i, block in enumerate(self.blocks):
            x, S, c = block(x, rec[i], None if conv is None else conv[i], step=True)
            new_rec.append(S)
            new_conv.append(c)
        self._write(state, slots, new_rec, new_conv)
        return self._logits(x[:, 0])

    @staticmethod
    def _read(state: State, slots: Tensor | None):
        if slots is None:
            return state.recurrent, state.conv
        conv = None if state.conv is None else state.conv.index_select(1, slots)
        return state.recurrent.index_select(1, slots), conv

    @staticmethod
    def _write(state: State, slots: Tensor | None, rec: list[Tensor], conv: list[Tensor | None]) -> None:
        rec_t = torch.stack(rec).to(state.recurrent.dtype)
        if slots is None:
            state.recurrent.copy_(rec_t)
        else:
            state.recurrent.index_copy_(1, slots, rec_t)
        if state.conv is not None:
            conv_t = torch.stack(conv).to(state.conv.dtype)
            if slots is None:
                state.conv.copy_(conv_t)
            else:
                state.conv.index_copy_(1, slots, conv_t)

    def allocate_state(self, batch: int, device=None, dtype: torch.dtype | None = None) -> State:
        p = next(self.parameters())
        return State.allocate(self.cfg, batch, device=device or p.device, dtype=dtype or p.dtype)
