"""A tokenizer.json on disk: loading it, and its canonical hash. A base module: the data room
writes tokenizers and the model room's exports carry one, and neither may import the other."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tokenizers import Tokenizer

from laplace.errors import DataError, one_line


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
