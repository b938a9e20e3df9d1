"""The byte-level BPE tokenizer: training, loading, a canonical hash, and the encoder the
tokenize workers run."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from laplace.errors import DataError, one_line

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


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A tokenizer.json. Text is never encoded as special tokens: a literal "<|endoftext|>" in a
    document stays text (this runtime flag is not saved in tokenizer.json, so it is set here)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: tokenizer file not found")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:
        raise DataError(f"{path}: not a valid tokenizer.json ({one_line(exc)})") from exc
    tokenizer.encode_special_tokens = True
    return tokenizer


def tokenizer_sha256(tok: Tokenizer) -> str:
    """sha256 of the tokenizer's canonical JSON (sorted keys), independent of file formatting."""
    canonical = json.dumps(json.loads(tok.to_str()), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


class _DocumentEncoder:
    """datasets.map function: the token ids of each text followed by EOS.

    Holds the tokenizer as JSON so worker processes rebuild it with encode_special_tokens set
    (that flag does not survive pickling).
    """

    def __init__(self, tokenizer_json: str, eos_id: int):
        self.tokenizer_json = tokenizer_json
        self.eos_id = eos_id
        self._tokenizer: Tokenizer | None = None

    def __getstate__(self):
        return {"tokenizer_json": self.tokenizer_json, "eos_id": self.eos_id, "_tokenizer": None}

    def __call__(self, batch: dict) -> dict:
        if self._tokenizer is None:
            self._tokenizer = Tokenizer.from_str(self.tokenizer_json)
            self._tokenizer.encode_special_tokens = True
        encodings = self._tokenizer.encode_batch_fast(batch["text"], add_special_tokens=False)
        return {"ids": [encoding.ids + [self.eos_id] for encoding in encodings]}


@contextlib.contextmanager
def _quiet_forked_tokenizers(num_proc: int):
    """Forked map workers must not use tokenizers' thread pool (it may deadlock after a fork);
    saying so up front also silences tokenizers' fork warning. The parent keeps its threads."""
    if num_proc <= 1 or "TOKENIZERS_PARALLELISM" in os.environ:
        yield
        return
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        os.environ.pop("TOKENIZERS_PARALLELISM", None)
