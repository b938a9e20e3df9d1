"""The Gated DeltaNet layer (fla's fla/layers/gated_deltanet.py), on the gated delta rule of
laplace.model.gated_deltanet through laplace.model.kernels (torch, or fla's Triton kernels on CUDA)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from laplace.model import kernels
from laplace.model.config import ModelConfig
from laplace.model.gated_deltanet import l2_normalize
from laplace.model.gla import accum_dtype
from laplace.model.layers import RMSNorm, ShortConvolution


def init_a_log(t: Tensor, generator: torch.Generator) -> Tensor:
    """fla's A_log: log A, A uniform in (0, 16) (Mamba2's range of decay rates)."""
    return t.uniform_(0, 16, generator=generator).clamp_min_(1e-4).log_()


def init_dt_bias(t: Tensor, generator: torch.Generator, dt_range: tuple[float, float] = (1e-3, 0.1)) -> Tensor:
    """fla's dt_bias: softplus^-1(dt), dt log-uniform in `dt_range` (fla's: [1e-3, 0.1]) floored at 1e-4
    (Mamba2); model.gdn.dt_init_range sets the range."""
    lo, hi = math.log(dt_range[0]), math.log(dt_range[1])
    dt = (t.uniform_(0, 1, generator=generator) * (hi - lo) + lo).exp().clamp_min(1e-4)
    return dt + torch.log(-torch.expm1(-dt))


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet layer (fla conventions): q/k/v projections through short convolutions (SiLU),
    L2-normalised q and k, beta = sigmoid(b_proj x) (2 sigmoid with allow_neg_eigval), the Mamba2
    decay g = -exp(A_log) softplus(a_proj x + dt_bias), a per-head RMSNorm gated by swish(g_proj x).
    The state is one [K/H, V/HV] matrix per value head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        spec, dims = cfg.gdn_spec, cfg.gdn_dims()
        D, K, V, HV = cfg.d_model, dims["K"], dims["V"], dims["HV"]
        self.dims, self.allow_neg_eigval = dims, spec["allow_neg_eigval"]
        self.q_proj = nn.Linear(D, K, bias=False)
        self.k_proj = nn.Linear(D, K, bias=False)
        self.v_proj = nn.Linear(D, V, bias=False)
        self.a_proj = nn.Linear(D, HV, bias=False)
        self.b_proj = nn.Linear(D, HV, bias=False)
        self.A_log = nn.Parameter(torch.empty(HV))
        self.dt_bias = nn.Parameter(torch.empty(HV))
        if cfg.use_short_conv:
            self.q_conv = ShortConvolution(K, cfg.conv_size)
            self.k_conv = ShortConvolution(K, cfg.conv_size)
            self.v_conv = ShortConvolution(V, cfg.conv_size)
        self.g_proj = nn.Linear(D, V, bias=False)
        self.o_norm = RMSNorm(dims["Vh"], cfg.norm_eps)
        self.o_proj = nn.Linear(V, D, bias=False)

    def _inputs(self, x: Tensor, conv: Tensor | None, lengths: Tensor | None):
        """(q, k [B,T,H,Kh] normalised, v [B,T,HV,Vh], g, beta [B,T,HV] in fp32/fp64, new conv cache)."""
        d = self.dims
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        new_conv = None
        if self.cfg.use_short_conv:
            cq, ck, cv = (None, None, None) if conv is None else conv.split([d["K"], d["K"], d["V"]], dim=-1)
            q, cq = self.q_conv(q, cq, lengths)
            k, ck = self.k_conv(k, ck, lengths)
            v, cv = self.v_conv(v, cv, lengths)
            new_conv = torch.cat([cq, ck, cv], dim=-1)
        else:  # fla's layer without convolutions applies the SiLU alone
            q, k, v = F.silu(q), F.silu(k), F.silu(v)
        B, T = x.shape[:2]
        dt = accum_dtype(x)
        q = l2_normalize(q.view(B, T, d["H"], d["Kh"]).to(dt))
        k = l2_normalize(k.view(B, T, d["H"], d["Kh"]).to(dt))
        v = v.view(B, T, d["HV"], d["Vh"])
        # gates in fp32 (fp64 for the reference), as fla's kernels compute them
        beta = torch.sigmoid(self.b_proj(x).to(dt)) * (2.0 if self.allow_neg_eigval else 1.0)
        g = -self.A_log.to(dt).exp() * F.softplus(self.a_proj(x).to(dt) + self.dt_bias.to(dt))
        return q, k, v, g, beta, new_conv

    def _output(self, x: Tensor, o: Tensor) -> Tensor:
        B, T = x.shape[:2]
        gate = self.g_proj(x).view(B, T, self.dims["HV"], self.dims["Vh"])
        o = self.o_norm(o.to(x.dtype)) * F.silu(gate)
        return self.o_proj(o.reshape(B, T, -1))

    def forward(
        self, x: Tensor, recurrent: Tensor | None = None, conv: Tensor | None = None, lengths: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Chunked form over [B, T, D]. Returns (y, final state [B,HV,Kh,Vh], conv cache)."""
        q, k, v, g, beta, new_conv = self._inputs(x, conv, lengths)
        kernel = kernels.resolve_kernel(self.cfg.kernel, x.device, x.dtype)
        o, S = kernels.gdn_chunk(
            kernel,
            q,
            k,
            v,
            g,
            beta,
            initial_state=recurrent,
            lengths=lengths,
            chunk_size=self.cfg.chunk_size,
            segment_len=self.cfg.segment_len,
        )
        return self._output(x, o), S, new_conv

    def step(self, x: Tensor, recurrent: Tensor, conv: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
        """Recurrent form for one token per row: x [B, 1, D]."""
        q, k, v, g, beta, new_conv = self._inputs(x, conv, None)
        kernel = kernels.resolve_kernel(self.cfg.kernel, x.device, x.dtype)
        o, S = kernels.gdn_step(kernel, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], recurrent)
        return self._output(x, o.unsqueeze(1)), S, new_conv
