"""The GLA and Gated DeltaNet cores behind a switch: `model.kernel: auto | torch | fla`.

- `torch`: laplace.model.gla (chunk_gla for training and prefill, gla_step for decode): plain
  PyTorch, runs anywhere (CPU, CUDA, Trainium), and is the oracle the tests trust.
- `fla`: flash-linear-attention's Triton kernels (fla.ops.gla.chunk_gla, fused_recurrent_gla),
  CUDA only, from the optional extra `pip install 'laplace[cuda]'`.
- `auto`: fla on CUDA when it is installed, torch elsewhere; fp64 reference models always torch.

Both compute the same function: the same [B, T, H, K] / [B, H, K, V] layouts (fla's own), the
gate clamped at the same floor (`min_log_decay`, where the torch chunked form is exact), the
same scale (K^-1/2 by default, applied to q), an fp32 state, and right padding (`lengths`)
made an exact no-op by zeroing k, v and g past each row's length.

Gated DeltaNet goes the same way (`gdn_chunk`, `gdn_step`): laplace.model.gated_deltanet, or fla's
chunk_gated_delta_rule / fused_recurrent_gated_delta_rule on q and k the layer has already
L2-normalised, beta after its sigmoid and g in log space (so fla computes the same function).

fla's entry points are `torch.compiler.disable`d Python, which would break a
`torch.compile(fullgraph=True)` graph. So they are wrapped as torch.library custom ops
(`laplace::gla_chunk`, `laplace::gla_step`) with fake (meta) implementations, and the chunk op
gets an autograd formula: a backward op that recomputes the forward under enable_grad and asks
torch.autograd.grad (fla's own backward kernels). Dynamo then sees one opaque op. The op's
implementation is chosen by name (`OP_IMPLS`), so the CPU tests route the torch form through
the very same op machinery (fake impl, autograd, fullgraph compile) and compare.
"""

from __future__ import annotations

import contextlib
import importlib.util

import torch
from torch import Tensor

from laplace.errors import ConfigError
from laplace.model.config import KERNELS
from laplace.model.gated_deltanet import chunk_gated_delta_rule, gated_delta_step
from laplace.model.gla import accum_dtype, chunk_gla, gla_step, min_log_decay

FLA_EXTRA = "pip install 'laplace[cuda]'"


def fla_available() -> bool:
    """flash-linear-attention's ops (the `fla` package, fla-core) and Triton are importable."""
    return importlib.util.find_spec("fla") is not None and importlib.util.find_spec("triton") is not None


# Looked up once: the layer resolves its kernel on every call, also inside traced graphs, where
# only constants are cheap.
FLA_INSTALLED = fla_available()


def resolve_kernel(kernel: str, device: torch.device | str, dtype: torch.dtype | None = None) -> str:
    """`torch` or `fla` for a model on `device` in `dtype`; a one-line ConfigError naming
    model.kernel when fla is asked for where it cannot run."""
    device = torch.device(device)
    if kernel not in KERNELS:
        raise ConfigError(f"model.kernel: must be one of {', '.join(KERNELS)}, got {kernel!r}")
    if kernel == "torch" or dtype == torch.float64:  # the fp64 reference is always the torch form
        return "torch"
    if kernel == "fla":
        if not FLA_INSTALLED:
            raise ConfigError(f"model.kernel: fla needs flash-linear-attention and triton ({FLA_EXTRA})")
        if device.type != "cuda":
            raise ConfigError(f"model.kernel: fla runs on CUDA only, the model is on {device.type}")
        return "fla"
    return "fla" if device.type == "cuda" and FLA_INSTALLED else "torch"


# --------------------------------------------------------------------------- implementations


def _pad_to_no_op(k: Tensor, v: Tensor, g: Tensor, lengths: Tensor | None):
    """Zero k, v and g past each row's length (with `where`: NaN padding cannot leak)."""
    if lengths is None:
        return k, v, g
    real = (torch.arange(k.shape[1], device=k.device) < lengths.unsqueeze(-1))[:, :, None, None]
    return torch.where(real, k, 0.0), torch.where(real, v, 0.0), torch.where(real, g, 0.0)


def _torch_chunk(q, k, v, g, initial_state, lengths, scale, chunk_size, sub_chunk_size, segment_len):
    return chunk_gla(
        q,
        k,
        v,
        g,
        scale=scale,
        initial_state=initial_state,
        lengths=lengths,
        chunk_size=chunk_size,
        sub_chunk_size=sub_chunk_size,
        segment_len=segment_len,
    )


def _torch_step(q, k, v, g, state, scale, sub_chunk_size):
    return gla_step(q, k, v, g.clamp_min(min_log_decay(sub_chunk_size)), state, scale)


def _fla_chunk(q, k, v, g, initial_state, lengths, scale, chunk_size, sub_chunk_size, segment_len):
    from fla.ops.gla import chunk_gla as fla_chunk_gla

    k, v, g = _pad_to_no_op(k, v, g, lengths)
    g = g.float().clamp_min(min_log_decay(sub_chunk_size))  # the floor the torch form is exact at
    o, final = fla_chunk_gla(
        q,
        k.to(q.dtype),
        v.to(q.dtype),
        g,
        scale=scale,
        initial_state=initial_state.float(),
        output_final_state=True,
    )
    return o.to(v.dtype), final


def _fla_step(q, k, v, g, state, scale, sub_chunk_size):
    from fla.ops.gla import fused_recurrent_gla

    g = g.float().clamp_min(min_log_decay(sub_chunk_size))
    o, final = fused_recurrent_gla(
        q.unsqueeze(1),
        k.to(q.dtype).unsqueeze(1),
        v.to(q.dtype).unsqueeze(1),
        gk=g.unsqueeze(1),
        scale=scale,
        initial_state=state.float(),
        output_final_state=True,
    )
    return o[:, 0].to(state.dtype), final.to(state.dtype)


# name -> (chunk, step): what the custom ops run. `torch` is there so CPU tests can drive the op
# machinery with the reference form; the model routes only `fla` through the ops.
OP_IMPLS = {"torch": (_torch_chunk, _torch_step), "fla": (_fla_chunk, _fla_step)}


# --------------------------------------------------------------------------- the custom ops


@contextlib.contextmanager
def _autograd_inside_an_op():
    """A custom op's implementation runs below the autograd dispatch keys (autograd excluded);
    the backward op re-enables them to differentiate its recomputed forward."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor"):
        exclude = exclude.remove(getattr(torch._C.DispatchKey, key))
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude):
        yield


def _op_outputs(o: Tensor, final: Tensor, initial_state: Tensor) -> tuple[Tensor, Tensor]:
    """A chunk op's (o, final state) as an op must return them: contiguous, and never an input (a
    chunk of no tokens hands its initial state back: a copy)."""
    return o.contiguous(), final.clone() if final is initial_state else final.contiguous()


def _recomputed_grads(chunk, tensors, settings, grad_o: Tensor, grad_final: Tensor) -> tuple[Tensor, ...]:
    """A chunk backward op's body: `chunk(*tensors, *settings)` recomputed under enable_grad, then the
    implementation's own backward through torch.autograd.grad (fla: its Triton backward kernels);
    one grad per tensor, in its dtype (zeros where it does not reach)."""
    inputs = [t.detach().requires_grad_(True) for t in tensors]
    with _autograd_inside_an_op(), torch.enable_grad():
        o, final = chunk(*inputs, *settings)
        grads = torch.autograd.grad((o, final), inputs, (grad_o, grad_final), allow_unused=True)
    return tuple(torch.zeros_like(x) if d is None else d.to(x.dtype).contiguous() for x, d in zip(inputs, grads))


def _register_chunk_autograd(op, backward_op, n_tensors: int) -> None:
    """`op`'s autograd formula through `backward_op`: op's first n_tensors inputs (v third, the
    initial state last) and `lengths` after them are saved, the rest are settings passed on; a missing
    output grad is zeros (o is shaped as v, the final state as the initial one)."""

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[: n_tensors + 1])
        ctx.settings = inputs[n_tensors + 1 :]

    def backward(ctx, grad_o, grad_final):
        *tensors, lengths = ctx.saved_tensors
        grad_o = torch.zeros_like(tensors[2]) if grad_o is None else grad_o
        grad_final = torch.zeros_like(tensors[-1]) if grad_final is None else grad_final
        grads = backward_op(*tensors, lengths, grad_o.contiguous(), grad_final.contiguous(), *ctx.settings)
        return (*grads, *[None] * (1 + len(ctx.settings)))

    op.register_autograd(backward, setup_context=setup_context)


@torch.library.custom_op("laplace::gla_chunk", mutates_args=())
def gla_chunk_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    initial_state: Tensor,
    lengths: Tensor | None,
    scale: float,
    chunk_size: int,
    sub_chunk_size: int,
    segment_len: int,
    impl: str,
) -> tuple[Tensor, Tensor]:
    """Chunked GLA through OP_IMPLS[impl]: (o [B,T,H,V] in v's dtype, final state [B,H,K,V] fp32/fp64)."""
    o, final = OP_IMPLS[impl][0](q, k, v, g, initial_state, lengths, scale, chunk_size, sub_chunk_size, segment_len)
    return _op_outputs(o, final, initial_state)


@gla_chunk_op.register_fake
def _(q, k, v, g, initial_state, lengths, scale, chunk_size, sub_chunk_size, segment_len, impl):
    B, T, H, K = q.shape
    V = v.shape[-1]
    return v.new_empty(B, T, H, V), q.new_empty(B, H, K, V, dtype=accum_dtype(q, k, v, g))


@torch.library.custom_op("laplace::gla_chunk_backward", mutates_args=())
def gla_chunk_backward_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    initial_state: Tensor,
    lengths: Tensor | None,
    grad_o: Tensor,
    grad_final: Tensor,
    scale: float,
    chunk_size: int,
    sub_chunk_size: int,
    segment_len: int,
    impl: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dg, d initial_state): the forward recomputed under enable_grad, then the
    implementation's own backward through torch.autograd.grad (fla: its Triton backward kernels)."""
    settings = (lengths, scale, chunk_size, sub_chunk_size, segment_len)
    return _recomputed_grads(OP_IMPLS[impl][0], (q, k, v, g, initial_state), settings, grad_o, grad_final)


@gla_chunk_backward_op.register_fake
def _(q, k, v, g, initial_state, lengths, grad_o, grad_final, scale, chunk_size, sub_chunk_size, segment_len, impl):
    return tuple(torch.empty_like(x) for x in (q, k, v, g, initial_state))


_register_chunk_autograd(gla_chunk_op, gla_chunk_backward_op, n_tensors=5)


@torch.library.custom_op("laplace::gla_step", mutates_args=())
def gla_step_op(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, state: Tensor, scale: float, sub_chunk_size: int, impl: str
) -> tuple[Tensor, Tensor]:
    """One decode token through OP_IMPLS[impl]: (o [B,H,V] in the state's dtype, new state).
    Decode only (no autograd formula)."""
    o, new_state = OP_IMPLS[impl][1](q, k, v, g, state, scale, sub_chunk_size)
    return o.contiguous(), new_state.contiguous()


@gla_step_op.register_fake
def _(q, k, v, g, state, scale, sub_chunk_size, impl):
    B, H, _ = q.shape
    return state.new_empty(B, H, v.shape[-1]), torch.empty_like(state)


# --------------------------------------------------------------------------- what the layer calls


def chunk(
    kernel: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    *,
    initial_state: Tensor | None,
    lengths: Tensor | None,
    chunk_size: int,
    sub_chunk_size: int,
    segment_len: int,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Chunked GLA with a resolved kernel (`torch` or `fla`): (o in v's dtype, final state fp32)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if kernel == "torch":
        return _torch_chunk(q, k, v, g, initial_state, lengths, scale, chunk_size, sub_chunk_size, segment_len)
    if initial_state is None:
        B, _, H, K = q.shape
        initial_state = q.new_zeros(B, H, K, v.shape[-1], dtype=torch.float32)
    return gla_chunk_op(q, k, v, g, initial_state, lengths, scale, chunk_size, sub_chunk_size, segment_len, kernel)


def step(
    kernel: str, q: Tensor, k: Tensor, v: Tensor, g: Tensor, state: Tensor, *, sub_chunk_size: int, scale=None
) -> tuple[Tensor, Tensor]:
    """One decode token with a resolved kernel: (o [B,H,V] in the state's dtype, new state)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if kernel == "torch":
        return _torch_step(q, k, v, g, state, scale, sub_chunk_size)
    return gla_step_op(q, k, v, g, state, scale, sub_chunk_size, kernel)


# --------------------------------------------------------------------------- Gated DeltaNet


def _torch_gdn_chunk(q, k, v, g, beta, initial_state, lengths, scale, chunk_size, segment_len):
    return chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        lengths=lengths,
        chunk_size=chunk_size,
        segment_len=segment_len,
    )


def _torch_gdn_step(q, k, v, g, beta, state, scale):
    return gated_delta_step(q, k, v, g, beta, state, scale)


def _fla_gdn_chunk(q, k, v, g, beta, initial_state, lengths, scale, chunk_size, segment_len):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    if lengths is not None:  # padding writes nothing (beta 0) and decays nothing (g 0)
        real = (torch.arange(k.shape[1], device=k.device) < lengths.unsqueeze(-1))[:, :, None]
        k = torch.where(real[..., None], k, 0.0)
        v = torch.where(real[..., None], v, 0.0)
        g, beta = torch.where(real, g, 0.0), torch.where(real, beta, 0.0)
    dtype = v.dtype  # fla wants q, k, v and beta in one dtype; the gate and the state in fp32
    o, final = fla_chunk(
        q.to(dtype),
        k.to(dtype),
        v,
        g.float(),
        beta.to(dtype),
        scale=scale,
        initial_state=initial_state.float(),
        output_final_state=True,
    )
    return o.to(v.dtype), final


def _fla_gdn_step(q, k, v, g, beta, state, scale):
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    dtype = v.dtype
    o, final = fused_recurrent_gated_delta_rule(
        q.to(dtype).unsqueeze(1),
        k.to(dtype).unsqueeze(1),
        v.unsqueeze(1),
        g=g.float().unsqueeze(1),
        beta=beta.to(dtype).unsqueeze(1),
        scale=scale,
        initial_state=state.float(),
        output_final_state=True,
    )
    return o[:, 0].to(state.dtype), final.to(state.dtype)


GDN_OP_IMPLS = {"torch": (_torch_gdn_chunk, _torch_gdn_step), "fla": (_fla_gdn_chunk, _fla_gdn_step)}


@torch.library.custom_op("laplace::gdn_chunk", mutates_args=())
def gdn_chunk_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor,
    lengths: Tensor | None,
    scale: float,
    chunk_size: int,
    segment_len: int,
    impl: str,
) -> tuple[Tensor, Tensor]:
    """Chunked gated delta rule through GDN_OP_IMPLS[impl]: (o [B,T,HV,V] in v's dtype, final state)."""
    o, final = GDN_OP_IMPLS[impl][0](q, k, v, g, beta, initial_state, lengths, scale, chunk_size, segment_len)
    return _op_outputs(o, final, initial_state)


@gdn_chunk_op.register_fake
def _(q, k, v, g, beta, initial_state, lengths, scale, chunk_size, segment_len, impl):
    B, T, HV, V = v.shape
    return v.new_empty(B, T, HV, V), q.new_empty(B, HV, q.shape[-1], V, dtype=accum_dtype(q, k, v, g, beta))


@torch.library.custom_op("laplace::gdn_chunk_backward", mutates_args=())
def gdn_chunk_backward_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor,
    lengths: Tensor | None,
    grad_o: Tensor,
    grad_final: Tensor,
    scale: float,
    chunk_size: int,
    segment_len: int,
    impl: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dg, dbeta, d initial_state): the forward recomputed under enable_grad, then the
    implementation's own backward (fla: its Triton kernels), as gla_chunk_backward_op does."""
    settings = (lengths, scale, chunk_size, segment_len)
    return _recomputed_grads(GDN_OP_IMPLS[impl][0], (q, k, v, g, beta, initial_state), settings, grad_o, grad_final)


@gdn_chunk_backward_op.register_fake
def _(q, k, v, g, beta, initial_state, lengths, grad_o, grad_final, scale, chunk_size, segment_len, impl):
    return tuple(torch.empty_like(x) for x in (q, k, v, g, beta, initial_state))


_register_chunk_autograd(gdn_chunk_op, gdn_chunk_backward_op, n_tensors=6)


@torch.library.custom_op("laplace::gdn_step", mutates_args=())
def gdn_step_op(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, scale: float, impl: str
) -> tuple[Tensor, Tensor]:
    """One decode token through GDN_OP_IMPLS[impl]: (o [B,HV,V] in the state's dtype, new state)."""
    o, new_state = GDN_OP_IMPLS[impl][1](q, k, v, g, beta, state, scale)
    return o.contiguous(), new_state.contiguous()


@gdn_step_op.register_fake
def _(q, k, v, g, beta, state, scale, impl):
    return state.new_empty(state.shape[0], state.shape[1], state.shape[-1]), torch.empty_like(state)


def gdn_chunk(
    kernel: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    initial_state: Tensor | None,
    lengths: Tensor | None,
    chunk_size: int,
    segment_len: int,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Chunked gated delta rule with a resolved kernel (`torch` or `fla`): (o in v's dtype, final state)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if kernel == "torch":
        return _torch_gdn_chunk(q, k, v, g, beta, initial_state, lengths, scale, chunk_size, segment_len)
    if initial_state is None:
        B, _, HV, V = v.shape
        initial_state = q.new_zeros(B, HV, q.shape[-1], V, dtype=torch.float32)
    return gdn_chunk_op(q, k, v, g, beta, initial_state, lengths, scale, chunk_size, segment_len, kernel)


def gdn_step(
    kernel: str, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, *, scale=None
) -> tuple[Tensor, Tensor]:
    """One decode token with a resolved kernel: (o [B,HV,V] in the state's dtype, new state)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if kernel == "torch":
        return _torch_gdn_step(q, k, v, g, beta, state, scale)
    return gdn_step_op(q, k, v, g, beta, state, scale, kernel)
