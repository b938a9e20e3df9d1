"""The GLA language model: embeddings, pre-norm blocks (GLA, Gated DeltaNet or attention + SwiGLU),
head, and its State.

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
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from laplace.model import kernels
from laplace.model.attention import SoftmaxAttention
from laplace.model.config import ModelConfig
from laplace.model.gated_deltanet_layer import GatedDeltaNet, init_a_log, init_dt_bias
from laplace.model.gla import accum_dtype
from laplace.model.layers import RMSNorm, ShortConvolution, conv_init_bound
from laplace.sharding import local_rows

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def torch_dtype(name: str) -> torch.dtype:
    return DTYPES[name]


# --------------------------------------------------------------------------- state


@dataclass
class State:
    """Fixed-size decode state of a batch of sequences, all layers. Every field is a tensor with
    the sequence (the row, a serving slot) at dimension 1, or None: rows are picked, copied and
    zeroed the same way for all of them.

    recurrent: [L_gla, B, H, K/H, V/H] the GLA layers' matrix state, always fp32 (fp64 for references).
    conv:      [L_gla, B, conv_size-1, 2K+V] the last inputs of the short convolutions, in the
               activation dtype (None without short convolutions).
    keys, values: [L_attn, B, max_context, W] the softmax attention layers' K (after RoPE) and V,
               in the activation dtype, a static-shape cache; layer a uses the first H_kv * head dim
               of W (W is the widest layer's; every layer's when they share a spec). None for GLA.
    positions: [1, B] int64 tokens each sequence has consumed (None for a GLA model, whose state
               does not depend on where it is).
    delta:     [L_gdn, B, HV, K/H, V/HV] the Gated DeltaNet layers' matrix state, fp32 (fp64 for
               references); None without such layers.
    delta_conv: [L_gdn, B, conv_size-1, 2K+V] their short convolutions' last inputs (GDN's K, V).
    """

    recurrent: Tensor
    conv: Tensor | None
    keys: Tensor | None = None
    values: Tensor | None = None
    positions: Tensor | None = None
    delta: Tensor | None = None
    delta_conv: Tensor | None = None

    @classmethod
    def allocate(
        cls,
        cfg: ModelConfig,
        batch: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        state_dtype: torch.dtype | None = None,
        max_context: int | None = None,
    ) -> State:
        """max_context: the tokens each attention layer's K/V cache holds per sequence (required
        when the model has attention layers; 0 allocates an empty cache, for counting)."""
        dtype = dtype or torch_dtype(cfg.dtype)
        state_dtype = state_dtype or (torch.float64 if dtype == torch.float64 else torch.float32)
        n_gla = len(cfg.gla_layers)
        rec = torch.zeros(n_gla, batch, cfg.n_heads, cfg.head_k_dim, cfg.head_v_dim, device=device, dtype=state_dtype)
        conv = keys = values = positions = None
        if cfg.use_short_conv:
            width = 2 * cfg.key_dim + cfg.value_dim
            conv = torch.zeros(n_gla, batch, cfg.conv_size - 1, width, device=device, dtype=dtype)
        if cfg.attn_layers:
            if max_context is None:
                raise ValueError("a model with attention layers needs max_context for its K/V cache")
            shape = (len(cfg.attn_layers), batch, max_context, kv_width(cfg))
            keys = torch.zeros(shape, device=device, dtype=dtype)
            values = torch.zeros(shape, device=device, dtype=dtype)
            positions = torch.zeros(1, batch, device=device, dtype=torch.long)
        delta = delta_conv = None
        if cfg.gdn_layers:
            d, n_gdn = cfg.gdn_dims(), len(cfg.gdn_layers)
            delta = torch.zeros(n_gdn, batch, d["HV"], d["Kh"], d["Vh"], device=device, dtype=state_dtype)
            if cfg.use_short_conv:
                width = 2 * d["K"] + d["V"]
                delta_conv = torch.zeros(n_gdn, batch, cfg.conv_size - 1, width, device=device, dtype=dtype)
        return cls(rec, conv, keys, values, positions, delta, delta_conv)

    @property
    def batch_size(self) -> int:
        return self.recurrent.shape[1]

    @property
    def max_context(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes held by the fixed-size state tensors (matrix states and convolution caches of GLA and
        Gated DeltaNet layers; the K/V cache apart)."""
        return sum(_bytes(t) for t in (self.recurrent, self.conv, self.delta, self.delta_conv))

    @property
    def kv_nbytes(self) -> int:
        """Bytes held by the attention layers' K/V cache (the 8-byte position counters apart)."""
        return sum(_bytes(t) for t in (self.keys, self.values))

    @property
    def bytes_per_sequence(self) -> int:
        return self.nbytes // self.batch_size

    @property
    def kv_bytes_per_sequence(self) -> int:
        return self.kv_nbytes // self.batch_size

    def tensors(self) -> dict[str, Tensor]:
        """The fields that hold a tensor, by name (row at dimension 1)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def zero_(self, rows: Tensor | None = None) -> State:
        for t in self.tensors().values():
            if rows is None:
                t.zero_()
            else:
                t.index_fill_(1, rows, 0)
        return self

    def select(self, rows: Tensor, kv_tokens: int | None = None) -> State:
        """A copy of the given rows (a batch of sequences); with `kv_tokens`, only the first that
        many positions of the K/V cache (all a sequence of that many tokens has written)."""
        out = {k: t.index_select(1, rows) for k, t in self.tensors().items()}
        for k in ("keys", "values"):
            if k in out and kv_tokens is not None:
                out[k] = out[k][:, :, :kv_tokens].clone()
        return State(**{f.name: out.get(f.name) for f in fields(self)})

    def restore(self, rows: Tensor, saved: State) -> None:
        """Write a `select`ed copy back into rows `rows` (its K/V into the first positions of the
        cache; the positions after them stay as they are: masked until the sequence writes them)."""
        theirs = saved.tensors()
        for k, mine in self.tensors().items():
            if k in ("keys", "values"):
                mine = mine[:, :, : theirs[k].shape[2]]
            mine.index_copy_(1, rows, theirs[k])

    def clone(self) -> State:
        return State(
            **{f.name: None if getattr(self, f.name) is None else getattr(self, f.name).clone() for f in fields(self)}
        )


def _bytes(t: Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def kv_width(cfg: ModelConfig) -> int:
    """Values per token per layer of each of K and V in the cache: the widest attention layer's
    H_kv * head dim (layers of one spec, the usual case, all have it)."""
    return max(s["num_kv_heads"] * (cfg.d_model // s["num_heads"]) for s in cfg.attn_specs)


def analytic_state_bytes(cfg: ModelConfig, dtype: torch.dtype | None = None) -> int:
    """The formula behind State.allocate's fixed-size part, per sequence: over the GLA layers
    L_gla*H*(K/H)*(V/H)*4 + L_gla*(conv-1)*(2K+V)*itemsize, and over the Gated DeltaNet layers
    L_gdn*HV*(K/H)*(V/HV)*4 + L_gdn*(conv-1)*(2K+V)*itemsize with their own K and V."""
    dtype = dtype or torch_dtype(cfg.dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    rec_itemsize = 8 if dtype == torch.float64 else 4
    n_gla = len(cfg.gla_layers)
    total = n_gla * cfg.n_heads * cfg.head_k_dim * cfg.head_v_dim * rec_itemsize
    if cfg.use_short_conv:
        total += n_gla * (cfg.conv_size - 1) * (2 * cfg.key_dim + cfg.value_dim) * itemsize
    if cfg.gdn_layers:
        d, n_gdn = cfg.gdn_dims(), len(cfg.gdn_layers)
        total += n_gdn * d["HV"] * d["Kh"] * d["Vh"] * rec_itemsize
        if cfg.use_short_conv:
            total += n_gdn * (cfg.conv_size - 1) * (2 * d["K"] + d["V"]) * itemsize
    return total


def analytic_kv_bytes(cfg: ModelConfig, tokens: int, dtype: torch.dtype | None = None) -> int:
    """The formula behind State.allocate's K/V cache, per sequence holding `tokens` positions:
    2 (K and V) * L_attn * tokens * W * itemsize, W = H_kv * head_dim (the widest layer's when specs
    differ). A windowed layer keeps every position too: Laplace's cache is not a ring buffer. 0 for GLA."""
    if not cfg.attn_layers:
        return 0
    itemsize = torch.empty((), dtype=dtype or torch_dtype(cfg.dtype)).element_size()
    return 2 * len(cfg.attn_layers) * tokens * kv_width(cfg) * itemsize


def sequence_bytes(cfg: ModelConfig, tokens: int, dtype: torch.dtype | None = None) -> dict[str, int]:
    """What one sequence of `tokens` tokens holds while decoding, for any architecture:
    {"state_bytes": fixed-size GLA state, "kv_bytes": attention K/V, "total_bytes": their sum}."""
    state, kv = analytic_state_bytes(cfg, dtype), analytic_kv_bytes(cfg, tokens, dtype)
    return {"state_bytes": state, "kv_bytes": kv, "total_bytes": state + kv}


def kv_cache_bytes(cfg: ModelConfig, tokens: int, bytes_per_value: int = 2) -> int:
    """K and V cache of a softmax transformer with the same layers and hidden size (no GQA)."""
    return 2 * cfg.n_layers * tokens * cfg.d_model * bytes_per_value


# The State fields of each kind of fixed-state layer: (matrix states, short-convolution caches)
GLA_FIELDS = ("recurrent", "conv")
GDN_FIELDS = ("delta", "delta_conv")

# --------------------------------------------------------------------------- initialisation

_INIT_BLOCK_VALUES = 1 << 16  # each block of rows draws from its own generator


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
    """Pre-norm block: a token mixer (GLA; softmax attention where `attn` names the layer, as fla's
    GLABlock with get_attention; Gated DeltaNet where `gdn` names it) and a SwiGLU MLP."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        spec = cfg.attention_spec(layer)
        self.is_attention = spec is not None
        self.is_delta = layer in cfg.gdn_layers  # its state lives in State.delta / delta_conv
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if spec is not None:
            self.attn = SoftmaxAttention(cfg, spec)
        else:
            self.attn = GatedDeltaNet(cfg) if self.is_delta else GatedLinearAttention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.ffn_dim)

    def forward(self, x, recurrent=None, conv=None, lengths=None, step: bool = False, kv=None):
        """GLA and Gated DeltaNet: (x, matrix state, conv) in, (x, new state, new conv) out. Attention: `kv` =
        (keys, values, rows, positions) of the cache (None: the full forward from position 0),
        updated in place; returns (x, None, None)."""
        h = self.attn_norm(x)
        S = c = None
        if self.is_attention:
            if kv is None:
                a = self.attn(h)
            elif step:
                a = self.attn.step(h, *kv)
            else:
                a = self.attn.prefill(h, *kv, lengths)
        elif step:
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
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
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
            elif name.endswith("attn.A_log"):
                _seeded_fill_(p, base, name, init_a_log)
            elif name.endswith("attn.dt_bias"):
                dt_range = cfg.gdn_spec["dt_init_range"]  # model.gdn.dt_init_range: fla's by default
                _seeded_fill_(p, base, name, lambda t, g, r=dt_range: init_dt_bias(t, g, r))
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
        rows, start = self._rows(state, slots, tokens)
        x = self._mix(x, state, slots, rows, start, lengths=lengths, step=False)
        if state.positions is not None:
            consumed = torch.full_like(start, tokens.shape[1]) if lengths is None else lengths
            state.positions.index_copy_(1, rows, (start + consumed).view(1, -1))
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
        rows, start = self._rows(state, slots, tokens)
        x = self._mix(x, state, slots, rows, start, lengths=None, step=True)
        if state.positions is not None:
            state.positions.index_copy_(1, rows, (start + 1).view(1, -1))
        return self._logits(x[:, 0])

    def _mix(self, x, state: State, slots, rows, start, lengths, step: bool) -> Tensor:
        """Every block over x from the state rows `slots`, the new states written back. The i-th GLA
        layer owns recurrent[i] / conv[i], the i-th Gated DeltaNet layer delta[i] / delta_conv[i]."""
        read = {fields: self._read(state, slots, fields) for fields in (GLA_FIELDS, GDN_FIELDS)}
        new = {GLA_FIELDS: ([], []), GDN_FIELDS: ([], [])}
        for block, kv in self._layers(state, rows, start):
            if block.is_attention:
                x, _, _ = block(x, lengths=lengths, step=step, kv=kv)
                continue
            fields = GDN_FIELDS if block.is_delta else GLA_FIELDS
            (rec, conv), (new_rec, new_conv) = read[fields], new[fields]
            i = len(new_rec)
            x, S, c = block(x, rec[i], None if conv is None else conv[i], lengths, step=step)
            new_rec.append(S)
            new_conv.append(c)
        for fields, (new_rec, new_conv) in new.items():
            self._write(state, slots, fields, new_rec, new_conv)
        return x

    @staticmethod
    def _rows(state: State, slots: Tensor | None, tokens: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """(the state rows a call works on, their positions so far): only attention layers need them."""
        if state.positions is None:
            return slots, None
        rows = torch.arange(tokens.shape[0], device=tokens.device) if slots is None else slots
        return rows, state.positions.index_select(1, rows)[0]

    def _layers(self, state: State, rows: Tensor | None, start: Tensor | None):
        """(block, its K/V cache arguments or None) in order; the i-th attention layer owns keys[i]."""
        a = 0
        for block in self.blocks:
            if block.is_attention:
                yield block, (block.attn.cache_view(state.keys[a]), block.attn.cache_view(state.values[a]), rows, start)
                a += 1
            else:
                yield block, None

    @staticmethod
    def _read(state: State, slots: Tensor | None, fields: tuple[str, str]):
        """(matrix states, conv caches) of one kind of layer, rows `slots` (None: absent)."""
        out = [getattr(state, name) for name in fields]
        if slots is None:
            return tuple(out)
        return tuple(None if t is None else t.index_select(1, slots) for t in out)

    @staticmethod
    def _write(
        state: State, slots: Tensor | None, fields: tuple[str, str], rec: list[Tensor], conv: list[Tensor | None]
    ) -> None:
        if not rec:  # no layer of this kind
            return
        for name, new in zip(fields, (rec, conv)):
            target = getattr(state, name)
            if target is None:
                continue
            new_t = torch.stack(new).to(target.dtype)
            if slots is None:
                target.copy_(new_t)
            else:
                target.index_copy_(1, slots, new_t)

    def allocate_state(
        self, batch: int, device=None, dtype: torch.dtype | None = None, max_context: int | None = None
    ) -> State:
        """max_context: positions of each attention layer's K/V cache (required with attention layers)."""
        p = next(self.parameters())
        return State.allocate(
            self.cfg, batch, device=device or p.device, dtype=dtype or p.dtype, max_context=max_context
        )
