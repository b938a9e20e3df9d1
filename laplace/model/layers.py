"""Building blocks every token mixer shares: the RMS norm and the short causal convolution (fla's)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from laplace.sharding import local_rows


def conv_init_bound(kernel_size: int) -> float:
    return 1.0 / math.sqrt(kernel_size)


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
