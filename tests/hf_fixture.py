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
from pathlib import Path

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


def fla_checkpoint(out: Path, seed: int = 0, **overrides) -> Path:
    """An fla GLAForCausalLM saved with save_pretrained (random weights, gates given some spread)."""
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
    model.save_pretrained(str(out))
    llama_style_tokenizer(out / "tokenizer.json")
    return out


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())
