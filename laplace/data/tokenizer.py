"""The byte-level BPE tokenizer: training, and the encoder the tokenize workers run (loading a
tokenizer.json and its canonical hash are laplace.tokenizer_file's, shared with the model's export)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from laplace.errors import DataError

EOS_TOKEN = "<|endoftext|>"
TOKENIZER_NAME = "tokenizer.json"


def train_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int) -> Tokenizer:
    """Train a deterministic byte-level BPE whose only special token is <|endoftext|> (id 0).

    `texts` may also yield lists of strings (batches). Every byte is in the base vocabulary, so
    any string encodes, and decode(encode(s).ids) == s.
    """
    if vocab_size < 257:
        raise DataError(f"tokenizer.vocab_size: must be >= 257 (256 bytes + {EOS_TOKEN}), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[EOS_TOKEN],
        show_progress=sys.stdout.isatty(),  # its bars print blank lines when stdout is a pipe
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.encode_special_tokens = True
    return tokenizer


def train_reaching(texts: Iterable[str], vocab_size: int, min_frequency: int, sample_note: str) -> Tokenizer:
    """train_tokenizer, and a DataError when the text cannot reach vocab_size: a smaller vocabulary
    would silently disagree with tokenizer.vocab_size (and the model's vocabulary that follows it)."""
    tokenizer = train_tokenizer(texts, vocab_size, min_frequency)
    reached = tokenizer.get_vocab_size(with_added_tokens=True)
    if reached < vocab_size:
        raise DataError(
            f"tokenizer.vocab_size: {vocab_size} asked, but {sample_note} reaches only {reached} tokens "
            f"(at tokenizer.min_frequency={min_frequency}): set tokenizer.vocab_size to {reached} or give more text"
        )
    return tokenizer


def given_tokenizer_file(value: str | Path) -> Path:
    """tokenizer.from as a file: a tokenizer.json itself, or the one inside a directory (a
    `laplace import`, an export, an HF checkpoint). A DataError names what is missing."""
    path = Path(value)
    if path.is_dir():
        if not (path / TOKENIZER_NAME).is_file():
            raise DataError(f"tokenizer.from: {path} is a directory without a {TOKENIZER_NAME}")
        return path / TOKENIZER_NAME
    return path


def document_start_ids(tokenizer: Tokenizer) -> list[int]:
    """The ids the tokenizer's own post-processor puts before a text (Llama's <s>; none for
    Laplace's BPE): each document in the token stream starts with them, as the model saw its
    training text. Measured from an encoding rather than read from the post-processor's JSON,
    which has several schemas (TemplateProcessing, BertProcessing, a Sequence of them)."""
    probe = "a"
    bare = tokenizer.encode(probe, add_special_tokens=False).ids
    full = tokenizer.encode(probe, add_special_tokens=True).ids
    for start in range(len(full) - len(bare) + 1):
        if full[start : start + len(bare)] == bare:
            return full[:start]
    return []


def document_end_id(tokenizer: Tokenizer, path: str | Path | None = None) -> int | None:
    """The id that ends each document in the token stream: <|endoftext|> for a tokenizer Laplace
    trained; for a given one (tokenizer.from) without it, the end-of-sequence token its model
    declares beside it: a Laplace export's config.json `eos_id`, an HF checkpoint's config.json
    `eos_token_id` or tokenizer_config.json `eos_token` (Llama's </s>). None when nothing says."""
    found = tokenizer.token_to_id(EOS_TOKEN)
    if found is not None or path is None:
        return found
    folder = Path(path).parent
    for name, key in (("config.json", "eos_id"), ("config.json", "eos_token_id"), ("tokenizer_config.json", None)):
        try:
            meta = json.loads((folder / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if key is not None:
            value = meta.get(key)
            value = value[0] if isinstance(value, list) and value else value
            if isinstance(value, int) and tokenizer.id_to_token(value) is not None:
                return value
            continue
        token = meta.get("eos_token")
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str) and tokenizer.token_to_id(token) is not None:
            return tokenizer.token_to_id(token)
    return None
