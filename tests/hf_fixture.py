"""Small checkpoints in the HF / flash-linear-attention layout, built by the tests (offline).

`llama_style_tokenizer` is a byte-level BPE with Llama's conventions: <unk>=0, <s>=1, </s>=2, and a
post-processor that adds <s> in front of every encoded text, as the fla-hub checkpoints' tokenizer.json.
`fla_checkpoint` writes config.json + model.safetensors with fla's own GLAConfig and save_pretrained
where flash-linear-attention is installed (the dev extra), and adds the tokenizer; a hybrid or
softmax one (`attn=...`) too: fla's Attention refuses to construct without flash-attn, so
`fla_attention_on_cpu` hands it `flash_attn_func` / `flash_attn_varlen_func` transcribed exactly in
torch (tests/fla_cpu_forward.py runs fla's whole forward that way, its Triton kernels interpreted).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from pathlib import Path
from unittest import mock

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

TEXT = (
    "The quick brown fox jumps over the lazy dog. A key is a word to remember; the value is its number. "
    "Gated linear attention keeps a fixed state whatever the length of the text it reads."
)


def llama_style_tokenizer(path: Path, vocab_size: int = 300) -> Path:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([TEXT] * 20, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), **_):
    """flash-attn's flash_attn_func in torch: q [B, Tq, H, D], k/v [B, Tk, Hkv, D]; query head h reads
    kv head h // (H/Hkv); causal aligned bottom-right (query i sees keys j <= i + Tk - Tq); window
    (left, right): keys within [i - left, i + right] of that diagonal (-1: unbounded)."""
    B, Tq, H, D = q.shape
    Tk, groups = k.shape[1], H // k.shape[2]
    k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    scores = torch.einsum("bihd,bjhd->bhij", q.float(), k.float()) * scale
    i = torch.arange(Tq).view(-1, 1) + (Tk - Tq)
    j = torch.arange(Tk).view(1, -1)
    allowed = torch.ones(Tq, Tk, dtype=torch.bool)
    if causal:
        allowed &= j <= i
    left, right = window_size
    if left >= 0:
        allowed &= j >= i - left
    if right >= 0:
        allowed &= j <= i + right
    p = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("bhij,bjhd->bihd", p, v.float()).to(q.dtype)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, **kw):
    """flash_attn_varlen_func in torch: packed [total, H, D] sequences, each attended alone."""
    out = []
    for n in range(len(cu_seqlens_q) - 1):
        qs = slice(int(cu_seqlens_q[n]), int(cu_seqlens_q[n + 1]))
        ks = slice(int(cu_seqlens_k[n]), int(cu_seqlens_k[n + 1]))
        out.append(flash_attn_func(q[None, qs], k[None, ks], v[None, ks], **kw)[0])
    return torch.cat(out)


@contextlib.contextmanager
def fla_attention_on_cpu():
    """fla.layers.attn with the torch flash-attn functions above (restored on exit)."""
    import fla.layers.attn as fla_attn

    saved = fla_attn.flash_attn_func, getattr(fla_attn, "flash_attn_varlen_func", None)
    fla_attn.flash_attn_func, fla_attn.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    try:
        yield
    finally:
        fla_attn.flash_attn_func, fla_attn.flash_attn_varlen_func = saved


def fla_checkpoint(out: Path, seed: int = 0, strong_gates: bool = False, **overrides) -> Path:
    """An fla GLAForCausalLM saved with save_pretrained (random weights, gates given some spread;
    `strong_gates`: gate biases drawn so per-token log decays spread over (-0.5, 0), where the gate's
    normaliser and clamp change the logits visibly; the attention projections scaled up 10x)."""
    from fla.models import GLAConfig, GLAForCausalLM

    fields = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_heads=2,
        vocab_size=320,
        use_short_conv=True,
        conv_size=4,
        bos_token_id=1,
        eos_token_id=2,
        fuse_norm=True,
    )
    fields.update(overrides)
    torch.manual_seed(seed)
    with fla_attention_on_cpu():
        model = GLAForCausalLM(GLAConfig(**fields))
    with torch.no_grad():  # fla's init leaves norms at 1 and biases at 0: perturb them so a swap shows
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
        if strong_gates:
            for name, p in model.named_parameters():
                if name.endswith("gk_proj.1.bias"):
                    p.uniform_(-8.0, 0.0)
                elif re.search(r"\.(q|k|g|o)_proj\.weight$", name):  # the attention branch, not the embeddings, decides
                    p.mul_(10.0)
    model.save_pretrained(str(out))
    llama_style_tokenizer(out / "tokenizer.json")
    return out


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


# --------------------------------------------------------------------------- fla's forward on CPU
# fla's layers call Triton kernels, which do not run on CPU. `fla_on_cpu` swaps only those entry
# points (the names fla's modules look up at call time) for plain-torch transcriptions of what the
# kernels compute, so fla's own modules, config handling and weight layout run unchanged: the
# reference is fla's model, not ours. The transcriptions are written from the kernels' definitions
# (recurrence, RMSNorm, SwiGLU, causal depthwise conv), independently of laplace.model.


def _rms(x, weight, bias, eps):
    dtype = torch.promote_types(x.dtype, torch.float32)
    y = x.to(dtype) * torch.rsqrt(x.to(dtype).pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(dtype)
    if bias is not None:
        y = y + bias.to(dtype)
    return y


def _rms_norm(x, weight, bias, residual=None, eps=1e-5, prenorm=False, residual_in_fp32=False, **_):
    if residual is not None:
        x = x + residual
    y = _rms(x, weight, bias, eps).to(x.dtype)
    return (y, x) if prenorm else y


def _rms_norm_gated(x, g, weight, bias, activation="swish", residual=None, prenorm=False, eps=1e-5, **_):
    if residual is not None:
        x = x + residual
    y = _rms(x, weight, bias, eps)
    gate = g.to(y.dtype)
    y = (y * gate * torch.sigmoid(gate) if activation in ("swish", "silu") else y * torch.sigmoid(gate)).to(x.dtype)
    return (y, x) if prenorm else y


def _swiglu_linear(x, y, weight, bias):
    return torch.nn.functional.linear(torch.nn.functional.silu(x) * y, weight, bias)


def _causal_conv1d(
    x, weight, bias=None, residual=None, initial_state=None, output_final_state=False, activation=None, **kw
):
    assert initial_state is None and kw.get("cu_seqlens") is None, "the CPU transcription covers a plain prefill"
    width = weight.shape[-1]  # y_t = sum_w weight[:, w] * x_{t-W+1+w}
    padded = torch.nn.functional.pad(x.transpose(1, 2), (width - 1, 0))
    y = torch.nn.functional.conv1d(padded, weight.unsqueeze(1), bias, groups=x.shape[-1]).transpose(1, 2)
    if activation in ("silu", "swish"):
        y = torch.nn.functional.silu(y)
    if residual is not None:
        y = y + residual
    final = padded[..., -width:] if output_final_state else None
    return y, final


def _gla_recurrence(q, k, v, g=None, gk=None, scale=None, initial_state=None, output_final_state=False, **kw):
    """S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T, o_t = scale * q_t S_t (per head; [B, T, H, D] inputs)."""
    assert kw.get("cu_seqlens") is None
    g = g if g is not None else gk
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    b, t, h, dk = q.shape
    state = q.new_zeros(b, h, dk, v.shape[-1], dtype=torch.promote_types(q.dtype, torch.float32))
    if initial_state is not None:
        state = state + (initial_state.transpose(-1, -2) if kw.get("state_v_first") else initial_state)
    out = []
    for i in range(t):
        state = state * g[:, i].exp()[..., None] + k[:, i, :, :, None] * v[:, i, :, None, :]
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, i] * scale, state))
    o = torch.stack(out, 1).to(v.dtype)
    final = (state.transpose(-1, -2) if kw.get("state_v_first") else state) if output_final_state else None
    return o, final


@contextlib.contextmanager
def fla_on_cpu():
    """fla's GLA modules with their Triton entry points replaced (see above), restored on exit."""
    import fla.layers.gla as gla_layer
    import fla.modules.causal_conv1d.ops as conv_ops
    import fla.modules.mlp as mlp
    import fla.modules.norm.fused_norm_gate as norm_gate
    import fla.modules.norm.layernorm as layernorm
    from fla.modules.activations import ACT2FN

    swaps = [
        (gla_layer, "chunk_gla", _gla_recurrence),
        (gla_layer, "fused_chunk_gla", _gla_recurrence),
        (gla_layer, "fused_recurrent_gla", _gla_recurrence),
        (conv_ops, "causal_conv1d", _causal_conv1d),
        (mlp, "swiglu_linear", _swiglu_linear),
        (mlp, "swiglu", lambda x, y: torch.nn.functional.silu(x) * y),
        (norm_gate, "rms_norm_gated", _rms_norm_gated),
        (layernorm, "rms_norm", _rms_norm),
    ]
    with contextlib.ExitStack() as stack:
        for module, name, fn in swaps:
            stack.enter_context(mock.patch.object(module, name, fn))
        # the output gate's activation (looked up when a layer is built: build models inside)
        stack.enter_context(
            mock.patch.dict(ACT2FN, {"swish": torch.nn.functional.silu, "silu": torch.nn.functional.silu})
        )
        yield


def fla_logits(model_dir: Path, tokens: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """fla's own GLAForCausalLM (from_pretrained on `model_dir`) run on CPU: the reference logits."""
    from fla.models import GLAForCausalLM

    with fla_on_cpu(), torch.no_grad():
        model = GLAForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
        return model(input_ids=tokens, use_cache=False).logits


# --------------------------------------------------------------------------- Gated DeltaNet


def _gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    use_beta_sigmoid_in_kernel=False,
    allow_neg_eigval=False,
    state_v_first=False,
    use_gate_in_kernel=False,
    A_log=None,
    dt_bias=None,
    **kw,
):
    """fla's chunk / fused_recurrent_gated_delta_rule as their docstrings define them, token by token
    in the inputs' precision (fp32 at least): l2norm(x) = x / sqrt(sum x^2 + 1e-6), beta = sigmoid
    (x2 with allow_neg_eigval), g = -exp(A_log) softplus(g + dt_bias), value head h reading q/k head
    h // (HV/H); S = exp(g) S; S += k (beta (v - S^T k))^T; o = S^T (scale q)."""
    assert kw.get("cu_seqlens") is None
    dtype = torch.promote_types(v.dtype, torch.float32)
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = (x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta) * (2.0 if allow_neg_eigval else 1.0)
    if use_gate_in_kernel:
        g = -A_log.to(dtype).exp() * torch.nn.functional.softplus(g + (0 if dt_bias is None else dt_bias.to(dtype)))
    b, t, hv, dv = v.shape
    q, k = (x.repeat_interleave(hv // x.shape[2], dim=2) for x in (q, k))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    state = q.new_zeros(b, hv, q.shape[-1], dv)
    if initial_state is not None:
        state = state + (initial_state.transpose(-1, -2) if state_v_first else initial_state).to(dtype)
    out = []
    for i in range(t):
        state = state * g[:, i].exp()[..., None, None]
        delta = beta[:, i, :, None] * (v[:, i] - torch.einsum("bhk,bhkv->bhv", k[:, i], state))
        state = state + k[:, i, :, :, None] * delta[:, :, None, :]
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, i] * scale, state))
    final = (state.transpose(-1, -2) if state_v_first else state) if output_final_state else None
    return torch.stack(out, 1), final


@contextlib.contextmanager
def fla_gdn_on_cpu():
    """fla's Gated DeltaNet modules with their Triton entry points replaced, as fla_on_cpu does GLA's."""
    import fla.layers.gated_deltanet as gdn_layer

    swaps = [
        (gdn_layer, "chunk_gated_delta_rule", _gated_delta_rule),
        (gdn_layer, "fused_recurrent_gated_delta_rule", _gated_delta_rule),
        (gdn_layer, "causal_conv1d", _causal_conv1d),  # the fused q/k/v convolution of a cache-less forward
    ]
    with fla_on_cpu(), contextlib.ExitStack() as stack:
        for module, name, fn in swaps:
            stack.enter_context(mock.patch.object(module, name, fn))
        yield


def fla_gdn_checkpoint(out: Path, seed: int = 0, **overrides) -> Path:
    """An fla GatedDeltaNetForCausalLM saved with save_pretrained (random weights; norms and the
    decay parameters given some spread, so a swapped or ignored one shows)."""
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM

    fields = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_heads=2,
        head_dim=16,
        expand_v=2.0,
        vocab_size=320,
        bos_token_id=1,
        eos_token_id=2,
    )
    fields.update(overrides)
    torch.manual_seed(seed)
    with fla_gdn_on_cpu(), fla_attention_on_cpu():
        model = GatedDeltaNetForCausalLM(GatedDeltaNetConfig(**fields))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and not name.endswith(("A_log", "dt_bias")):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0, 16).log())  # fla's own init, drawn again here
    model.save_pretrained(str(out))
    llama_style_tokenizer(out / "tokenizer.json")
    return out


def fla_gdn_logits(model_dir: Path, tokens: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """fla's own GatedDeltaNetForCausalLM (from_pretrained) run on CPU: the reference logits."""
    from fla.models import GatedDeltaNetForCausalLM

    with fla_gdn_on_cpu(), fla_attention_on_cpu(), torch.no_grad():
        model = GatedDeltaNetForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
        return model(input_ids=tokens, use_cache=False).logits
