"""nanoGPT's FineWeb tokenization (fineweb.py), restated for bench/tokenize_throughput.py: a process pool
encodes documents, the main process fills fixed-size uint16 shards. Its own module so that the
spawned pool can import it."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from pathlib import Path

import numpy as np

SHARD_TOKENS = 100_000_000 // 8  # both sides write shards of this size (several at 1 GB)


_tok = None


def _init(tokenizer_path: str) -> None:
    global _tok
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    _tok = Tokenizer.from_file(tokenizer_path)


def _encode(text: str) -> np.ndarray:
    ids = np.array([0] + _tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)  # EOT first, as fineweb.py
    return ids.astype(np.uint16)


def _documents(directory: Path):
    for path in sorted(directory.glob("*.jsonl")):
        with open(path, encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)["text"]


def nanogpt_style(corpus: Path, tokenizer_path: str, out: Path, workers: int) -> int:
    out.mkdir(parents=True, exist_ok=True)
    total, index = 0, 0
    buffer = np.empty((SHARD_TOKENS,), dtype=np.uint16)
    count = 0
    with mp.get_context("spawn").Pool(workers, initializer=_init, initargs=(tokenizer_path,)) as pool:
        for tokens in pool.imap(_encode, _documents(corpus), chunksize=16):
            while len(tokens):
                take = min(len(tokens), SHARD_TOKENS - count)
                buffer[count : count + take] = tokens[:take]
                count += take
                tokens = tokens[take:]
                if count == SHARD_TOKENS:
                    buffer.tofile(out / f"shard_{index:06d}.bin")
                    total, index, count = total + count, index + 1, 0
    if count:
        buffer[:count].tofile(out / f"shard_{index:06d}.bin")
        total += count
    return total
