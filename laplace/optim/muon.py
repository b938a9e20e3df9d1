"""Muon for hidden matrices, AdamW for everything else.

The Muon pieces are split into the three steps the sharded version reuses:
`momentum_direction` (element-wise, runs on any slice), `zeropower_via_newtonschulz`
(needs the whole matrix) and `apply_update_` (element-wise again). Run in order on
whole matrices they perform exactly the operations of `torch.optim.Muon`, so the
results are bit-identical (tests/test_muon.py checks it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from laplace.config import AdamWSection, MuonSection
from laplace.errors import ConfigError


def zeropower_via_newtonschulz(
    update: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> Tensor:
    """Quintic Newton-Schulz orthogonalisation in bf16 (the same ops as torch.optim.Muon)."""
    if update.ndim != 2:
        raise ValueError(f"Newton-Schulz needs a 2-D matrix, got shape {tuple(update.shape)}")
    a, b, c = coefficients
    x = update.bfloat16()
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
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


class Muon(torch.optim.Optimizer):
    """Single-process Muon with torch.optim.Muon's arguments and numerics."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315),
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
    ):
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=tuple(ns_coefficients),
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon only takes 2-D parameters, got shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                direction = momentum_direction(p.grad, state["momentum_buffer"], group["momentum"], group["nesterov"])
                ortho = zeropower_via_newtonschulz(direction, group["ns_coefficients"], group["ns_steps"], group["eps"])
                apply_update_(
                    p,
                    ortho,
                    group["lr"],
                    group["weight_decay"],
                    adjusted_lr(group["lr"], group["adjust_lr_fn"], p.shape),
                )
        return loss


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


class MuonAdamW:
    """The training optimizer: Muon + AdamW over one model, with a shared LR schedule scale."""

    def __init__(self, model: nn.Module, adamw_lr: float, adamw: AdamWSection, muon: MuonSection):
        self.routes = route_parameters(model)
        self.base_lrs = {"muon": muon.lr, "adamw": adamw_lr}
        self.muon = Muon(
            [p for _, p in self.routes["muon"]],
            lr=muon.lr,
            weight_decay=muon.weight_decay,
            momentum=muon.momentum,
            nesterov=muon.nesterov,
            ns_coefficients=tuple(muon.ns_coefficients),
            eps=muon.eps,
            ns_steps=muon.ns_steps,
            adjust_lr_fn=muon.adjust_lr_fn,
        )
        self.adamw = torch.optim.AdamW(
            [
                {"params": [p for _, p in self.routes["adamw_decay"]], "weight_decay": adamw.weight_decay},
                {"params": [p for _, p in self.routes["adamw_no_decay"]], "weight_decay": 0.0},
            ],
            lr=adamw_lr,
            betas=tuple(adamw.betas),
            eps=adamw.eps,
            foreach=False,
        )

    def set_lr_scale(self, scale: float) -> None:
        for g in self.muon.param_groups:
            g["lr"] = self.base_lrs["muon"] * scale
        for g in self.adamw.param_groups:
            g["lr"] = self.base_lrs["adamw"] * scale

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()

    def zero_grad(self) -> None:
        self.muon.zero_grad(set_to_none=True)
        self.adamw.zero_grad(set_to_none=True)

    # Optimizer state as named tensors (safetensors-friendly, nothing pickled).
    def state_tensors(self) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for name, p in self.routes["muon"]:
            st = self.muon.state.get(p)
            if st:
                out[f"muon/{name}/momentum_buffer"] = st["momentum_buffer"]
        for route in ("adamw_decay", "adamw_no_decay"):
            for name, p in self.routes[route]:
                st = self.adamw.state.get(p)
                if st:
                    for key in ("step", "exp_avg", "exp_avg_sq"):
                        out[f"adamw/{name}/{key}"] = st[key]
        return out

    def load_state_tensors(self, tensors: dict[str, Tensor]) -> None:
        expected = set()
        for name, p in self.routes["muon"]:
            key = f"muon/{name}/momentum_buffer"
            if key in tensors:
                self.muon.state[p]["momentum_buffer"] = tensors[key].to(p.device).clone()
                expected.add(key)
        for route in ("adamw_decay", "adamw_no_decay"):
            for name, p in self.routes[route]:
                keys = [f"adamw/{name}/{k}" for k in ("step", "exp_avg", "exp_avg_sq")]
                if all(k in tensors for k in keys):
                    st = self.adamw.state[p]
                    for k, full in zip(("step", "exp_avg", "exp_avg_sq"), keys):
                        st[k] = tensors[full].clone()
                    expected.update(keys)
        unknown = set(tensors) - expected
        if unknown:
            raise ValueError(f"optimizer state has entries for unknown parameters: {sorted(unknown)[:3]}")


def parameter_names(groups: dict[str, list[tuple[str, nn.Parameter]]]) -> Iterable[str]:
    for members in groups.values():
        for name, _ in members:
            yield name
