"""Small checkpoints in the HF / flash-linear-attention layout, built by the tests (offline).

`llama_style_tokenizer` is a byte-level BPE with Llama's conventions: <unk>=0, <s>=1, </s>=2, and a
post-processor that adds <s> in front of every encoded text, as the fla-hub checkpoints' tokenizer.json.
`fla_checkpoint` writes config.json + model.safetensors with fla's own GLAConfig and save_pretrained
where flash-linear-attention is installed (the dev extra), and adds the tokenizer.
"""

from __future__ import annotations

import json
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
