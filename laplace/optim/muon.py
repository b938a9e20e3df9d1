"""Muon's arithmetic, the bottom of laplace.optim: no process group, no optimizer class.

The sharded optimizer (laplace.optim.sharded) needs Muon cut into three steps:
`momentum_direction` (element-wise, runs on any rows), `zeropower_via_newtonschulz`
(needs the whole matrix) and `apply_update_` (element-wise again). Run in order they
perform exactly torch.optim.Muon's operations, so the results are bit-identical
(tests/test_muon.py checks it).

`CompiledMuonUpdate` runs the same three steps as three torch.compile graphs, each over every
matrix of the step at once, with the learning rate a 0-d tensor: the schedule changes its value,
never a guard, so the graphs compile once (per set of shapes) and never again.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from laplace.config import MuonSection
from laplace.errors import ConfigError
from laplace.runtime import compile_static

NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def cpu_multiplies_bf16() -> bool:
    """Whether this CPU has oneDNN's bf16 matmul (AVX-512 or ARM bf16). Without it ATen's bf16
    matmul is a scalar fallback: about 20x slower than fp32 on an AVX2 Zen 2 (64x64 by 64x256,
    one thread: 1.2 ms against 58 us)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def newton_schulz_dtype(choice: str, device: torch.device | str) -> torch.dtype:
    """The arithmetic of Newton-Schulz for `muon.ns_dtype`: bfloat16 (torch.optim.Muon's), float32,
    or auto: bfloat16 except on a CPU without native bf16 matmuls (cpu_multiplies_bf16), where
    float32 is both faster and more accurate. The update is rounded to bf16 either way."""
    if choice == "auto":
        slow_bf16 = torch.device(device).type == "cpu" and not cpu_multiplies_bf16()
        return torch.float32 if slow_bf16 else torch.bfloat16
    if choice not in NS_DTYPES:
        raise ConfigError(f"muon.ns_dtype: unknown value {choice!r} (choose from auto, {', '.join(NS_DTYPES)})")
    return NS_DTYPES[choice]


def zeropower_via_newtonschulz(
    update: Tensor,
    coefficients: tuple[float, float, float],
    steps: int,
    eps: float,
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """Quintic Newton-Schulz orthogonalisation: in bf16, the same ops as torch.optim.Muon (bit for
    bit); in fp32, the same ops in fp32, the result rounded to bf16 (the update's format either way,
    so every exchange and comm mode sees the same values)."""
    if update.ndim != 2:
        raise ValueError(f"Newton-Schulz needs a 2-D matrix, got shape {tuple(update.shape)}")
    a, b, c = coefficients
    x = update.to(dtype, copy=True)  # a copy: the in-place norm below must not touch the momentum
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    x = x.bfloat16()
    return x.T if tall else x


def newtonschulz_flops(rows: int, cols: int, steps: int) -> int:
    """Multiply-adds x2 of one orthogonalisation (for balancing owners and benchmarks)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * 2 * (m * m * n + m * m * m + m * m * n)


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: tuple[int, ...]) -> float:
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ConfigError(f"muon.adjust_lr_fn: unknown value {adjust_lr_fn!r}")


def momentum_direction(grad: Tensor, buf: Tensor, momentum: float, nesterov: bool) -> Tensor:
    """Update the momentum buffer in place (B = mu*B + (1-mu)*g) and return the direction to orthogonalise."""
    buf.lerp_(grad, 1 - momentum)
    return grad.lerp(buf, momentum) if nesterov else buf


def apply_update_(param: Tensor, ortho: Tensor, lr: float, weight_decay: float, lr_adjusted: float) -> None:
    """Decoupled weight decay, then the orthogonalised step (element-wise: works on slices)."""
    param.mul_(1 - lr * weight_decay)
    param.add_(ortho, alpha=-lr_adjusted)


def momentum_directions(grads: list[Tensor], bufs: list[Tensor], momentum: float, nesterov: bool) -> list[Tensor]:
    return [momentum_direction(g, b, momentum, nesterov) for g, b in zip(grads, bufs)]


def orthogonalise_all(
    matrices: list[Tensor],
    coefficients: tuple[float, float, float],
    steps: int,
    eps: float,
    dtype: torch.dtype = torch.bfloat16,
) -> list[Tensor]:
    return [zeropower_via_newtonschulz(m, coefficients, steps, eps, dtype) for m in matrices]


def apply_updates_(
    params: list[Tensor], orthos: list[Tensor], lr: Tensor, weight_decay: float, lr_factors: list[float]
) -> None:
    """apply_update_ with lr a 0-d tensor (lr_adjusted = lr * factor, the factor from the shape)."""
    for param, ortho, factor in zip(params, orthos, lr_factors):
        param.mul_(1 - lr * weight_decay)
        param.sub_(ortho.to(param.dtype) * (lr * factor))


class CompiledMuonUpdate:
    """Muon's momentum, Newton-Schulz and scaled update as three compiled graphs over lists of
    local tensors (one call per param group and phase, not per matrix: a Python loop of small
    element-wise kernels is what makes the eager step launch-bound on a GPU). The phases stay
    apart because between them the sharded optimizer exchanges rows with the other ranks.
    Numerically it is the eager pieces up to Inductor's fusion: the bf16 Newton-Schulz may round
    at other points (tests/test_muon.py states the tolerance)."""

    def __init__(self, backend: str = "inductor"):
        self.directions = compile_static(momentum_directions, backend)
        self.orthogonalise = compile_static(orthogonalise_all, backend)
        self.apply = compile_static(apply_updates_, backend)
        self._lrs: dict[tuple[int, torch.device], Tensor] = {}

    def lr_tensor(self, group_index: int, lr: float, device: torch.device) -> Tensor:
        """The group's learning rate in a persistent 0-d fp32 tensor, refilled in place each step."""
        key = (group_index, device)
        if key not in self._lrs:
            self._lrs[key] = torch.zeros((), dtype=torch.float32, device=device)
        return self._lrs[key].fill_(lr)


# --------------------------------------------------------------------------- routing


def route_parameters(model: nn.Module) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Split parameters by name: Muon takes the 2-D matrices inside the blocks; AdamW takes the
    embeddings and head (with weight decay) and every norm, bias and convolution (without)."""
    groups: dict[str, list[tuple[str, nn.Parameter]]] = {"muon": [], "adamw_decay": [], "adamw_no_decay": []}
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen:  # tied weights appear once
            continue
        seen.add(id(p))
        if name.startswith("blocks.") and p.ndim == 2:
            groups["muon"].append((name, p))
        elif name.startswith(("embed.", "lm_head.")):
            groups["adamw_decay"].append((name, p))
        else:
            groups["adamw_no_decay"].append((name, p))
    return groups


def muon_hyperparameters(muon: MuonSection) -> dict:
    """torch.optim.Muon's keyword arguments from the `muon:` section (ShardedMuon takes the same)."""
    return dict(
        lr=muon.lr,
        weight_decay=muon.weight_decay,
        momentum=muon.momentum,
        nesterov=muon.nesterov,
        ns_coefficients=tuple(muon.ns_coefficients),
        eps=muon.eps,
        ns_steps=muon.ns_steps,
        adjust_lr_fn=muon.adjust_lr_fn,
    )
