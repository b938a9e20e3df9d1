"""The token shards on disk: the writer that fills them (fixed-size shards, each finished by its
manifest), the manifest, and a split as one virtual array over its memory-mapped shards (what the
sampler, validation and the evals index into)."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import numpy as np

from laplace import manifest
from laplace.errors import DataError, one_line
from laplace.fileio import fsync_dir

KIND = "tokenized"  # the output directory's manifest
SHARD_KIND = "token-shard"  # each shard directory's manifest
SPLITS = ("train", "val")
TOKENS = "tokens.bin"


# --------------------------------------------------------------------------- writing


def shard_name(slice_index: int, part: int) -> str:
    return f"{slice_index:05d}-{part:04d}"


class ShardWriter:
    """One split of one slice as consecutive shards of exactly shard_tokens tokens (the last shorter).

    A document may straddle two shards; each finished shard's manifest records how many of the
    split's documents it completes (`docs_done`) and how many tokens of the next one it already
    holds (`carry`), which is all a resumed run needs to continue byte for byte.
    """

    def __init__(self, root: Path, split: str, slice_index: int, key: str, shard_tokens: int, dtype: np.dtype):
        self.dir, self.split, self.slice, self.key = root / split, split, slice_index, key
        self.shard_tokens, self.dtype = shard_tokens, dtype
        self.finished: list[dict] = []  # shard entries, in order
        self.docs_done = self.carry = self.tokens = 0
        self._handle = self._tmp = None
        self._digest = hashlib.sha256()
        self._in_shard = 0
        self.dir.mkdir(parents=True, exist_ok=True)
        self._resume()

    def _resume(self) -> None:
        """Adopt this slice's finished shards from an interrupted run of the same key; drop the rest."""
        part = 0
        while True:
            path = self.dir / shard_name(self.slice, part)
            found, _ = manifest.read_manifest(path, SHARD_KIND)
            entry = (found or {}).get("files", {}).get(TOKENS, {})
            ok = (
                found is not None
                and found.get("key") == self.key
                and not manifest.verify_file(path, TOKENS, entry, False)
            )
            if not ok:
                break
            self.finished.append(shard_entry(self.split, self.slice, part, found))
            self.docs_done, self.carry = found["docs_done"], found["carry"]
            self.tokens += found["tokens"]
            part += 1
        for stale in self.dir.glob(f"{self.slice:05d}-*"):
            if stale.name >= shard_name(self.slice, part):
                shutil.rmtree(stale, ignore_errors=True)

    def skip(self, doc_index: int) -> int | None:
        """Tokens of document `doc_index` already in finished shards (None: all of them)."""
        if doc_index < self.docs_done:
            return None
        return self.carry if doc_index == self.docs_done else 0

    def write(self, ids: np.ndarray, doc_index: int, skip: int) -> None:
        written = skip
        while written < len(ids):
            if self._handle is None:
                self._open()
            take = min(len(ids) - written, self.shard_tokens - self._in_shard)
            block = ids[written : written + take].tobytes()
            self._handle.write(block)
            self._digest.update(block)
            written += take
            self._in_shard += take
            self.tokens += take
            if self._in_shard == self.shard_tokens:
                done = written == len(ids)
                self._close(doc_index + 1 if done else doc_index, 0 if done else written)

    def finish(self, documents: int) -> None:
        if self._handle is not None:
            self._close(documents, 0)

    def _open(self) -> None:
        part = len(self.finished)
        self._tmp = self.dir / f".{shard_name(self.slice, part)}.tmp-{os.getpid()}"
        shutil.rmtree(self._tmp, ignore_errors=True)
        self._tmp.mkdir()
        self._handle = open(self._tmp / TOKENS, "wb")
        self._digest, self._in_shard = hashlib.sha256(), 0

    def _close(self, docs_done: int, carry: int) -> None:
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._handle.close()
        part = len(self.finished)
        fields = dict(
            split=self.split, slice=self.slice, part=part, tokens=self._in_shard, dtype=self.dtype.name,
            key=self.key, docs_done=docs_done, carry=carry,
        )  # fmt: skip
        entry = {"bytes": self._in_shard * self.dtype.itemsize, "sha256": self._digest.hexdigest()}
        written = manifest.write_manifest(self._tmp, SHARD_KIND, [TOKENS], known={TOKENS: entry}, **fields)
        final = self.dir / shard_name(self.slice, part)
        os.replace(self._tmp, final)
        fsync_dir(self.dir)
        self.finished.append(shard_entry(self.split, self.slice, part, written))
        self.docs_done, self.carry = docs_done, carry
        self._handle = self._tmp = None


def shard_entry(split: str, slice_index: int, part: int, found: dict) -> dict:
    tokens_file = found["files"][TOKENS]
    return {
        "path": f"{split}/{shard_name(slice_index, part)}",
        "tokens": found["tokens"],
        "bytes": tokens_file["bytes"],
        "sha256": tokens_file["sha256"],
    }


# --------------------------------------------------------------------------- reading


def read_manifest(dir: str | Path) -> dict:
    """The tokenized directory's manifest (laplace.manifest's format, kind "tokenized")."""
    found, reason = manifest.read_manifest(Path(dir), KIND)
    if found is None:
        raise DataError(f"{reason} (run the tokenize stage first)")
    return found


class TokenShards:
    """A split's shards, in order, read as one flat read-only array of token ids.

    Indexing takes an int, a slice or an integer array (the sampler's windows) and returns
    numpy values; windows may cross shard boundaries, so the sampler sees exactly the
    concatenation of the shards (the old single train.bin), whatever the shard size.
    Shards are memory-mapped on first use.
    """

    def __init__(self, root: Path, entries: list[dict], dtype: np.dtype, expected: dict[str, dict]):
        self.root, self.dtype = Path(root), dtype
        self.paths = [e["path"] for e in entries]
        self.expected = expected  # manifest entries of each tokens.bin (bytes, sha256)
        sizes = np.array([int(e["tokens"]) for e in entries], dtype=np.int64)
        self.offsets = np.concatenate(([0], np.cumsum(sizes)))
        self._maps: dict[int, np.memmap] = {}

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def shard(self, i: int) -> np.memmap:
        if i not in self._maps:
            size = int(self.offsets[i + 1] - self.offsets[i])
            self._maps[i] = np.memmap(self.root / self.paths[i] / TOKENS, dtype=self.dtype, mode="r", shape=(size,))
        return self._maps[i]

    def _gather(self, flat: np.ndarray) -> np.ndarray:
        if flat.size and (flat.min() < 0 or flat.max() >= len(self)):
            raise IndexError(f"token index out of range [0, {len(self)})")
        which = np.searchsorted(self.offsets, flat, side="right") - 1
        out = np.empty(flat.shape, dtype=self.dtype)
        for i in np.unique(which):
            mask = which == i
            out[mask] = self.shard(int(i))[flat[mask] - self.offsets[i]]
        return out

    def __getitem__(self, key):
        if isinstance(key, (int, np.integer)):
            index = int(key) + (len(self) if key < 0 else 0)
            return self._gather(np.array([index]))[0]
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                return self._gather(np.arange(start, stop, step))
            return self._range(start, stop)
        return self._gather(np.asarray(key, dtype=np.int64))

    def _range(self, start: int, stop: int) -> np.ndarray:
        if stop <= start:
            return np.empty(0, dtype=self.dtype)
        first = int(np.searchsorted(self.offsets, start, side="right") - 1)
        last = int(np.searchsorted(self.offsets, stop - 1, side="right") - 1)
        parts = [
            self.shard(i)[max(start - self.offsets[i], 0) : min(stop, self.offsets[i + 1]) - self.offsets[i]]
            for i in range(first, last + 1)
        ]
        return np.concatenate(parts) if len(parts) > 1 else np.asarray(parts[0])

    def __array__(self, dtype=None, copy=None):
        whole = self._range(0, len(self))
        return whole if dtype is None else whole.astype(dtype)

    def verify(self, indices: list[int] | None = None, checksum: bool = True) -> str:
        """ "" when the shards (all, or those at `indices`) match the manifest, else the first problem."""
        for i in range(len(self.paths)) if indices is None else indices:
            name = f"{self.paths[i]}/{TOKENS}"
            if reason := manifest.verify_file(self.root, name, self.expected[name], checksum=checksum):
                return reason
        return ""


def open_split(dir: str | Path, split: str, verify: bool = False) -> TokenShards:
    """The train or val split as one read-only TokenShards; sizes are always checked (cheap),
    verify=True also checks every shard's sha256 (see verify_share for a once-per-job check)."""
    if split not in SPLITS:
        raise DataError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    found = read_manifest(dir)
    where = Path(dir) / manifest.MANIFEST
    try:
        entries = found["shards"][split]
        dtype = np.dtype(found["dtype"]).newbyteorder("<")
        expected = {f"{e['path']}/{TOKENS}": found["files"][f"{e['path']}/{TOKENS}"] for e in entries}
        for e in entries:
            if expected[f"{e['path']}/{TOKENS}"].get("bytes") != int(e["tokens"]) * dtype.itemsize:
                raise ValueError(f"{e['path']} lists {e['tokens']} tokens but a different byte count")
    except (KeyError, TypeError, ValueError) as exc:
        raise DataError(f"{where}: incomplete entry for the {split} split ({one_line(exc)})") from exc
    tokens = TokenShards(Path(dir), entries, dtype, expected)
    if len(tokens) == 0:
        raise DataError(f"{Path(dir)}: the {split} split holds no tokens")
    if reason := tokens.verify(checksum=verify):
        raise DataError(reason)
    return tokens


def verify_share(splits: list[TokenShards], rank: int, world_size: int) -> str:
    """Check the sha256 of this rank's share of the shards (every world_size-th, from `rank`):
    with the verdicts combined across ranks, each shard is read once per job, not once per rank."""
    everything = [(s, i) for s in splits for i in range(len(s.paths))]
    for split, i in everything[rank::world_size]:
        if reason := split.verify([i]):
            return reason
    return ""


def data_digests(found: dict) -> dict:
    """What identifies the tokenized data a run trained on: the tokenizer and each split's shards."""
    files = found.get("files", {})
    out = {"tokenizer": found.get("tokenizer_sha256")}
    for split in SPLITS:
        shards = found.get("shards", {}).get(split, [])
        out[split] = [files.get(f"{e['path']}/{TOKENS}", {}).get("sha256") for e in shards]
    return out


def split_digest(found: dict, split: str) -> str:
    """One sha256 for a split (its shards' digests in order); "" when the manifest lists none.
    Two runs measured their validation loss on the same tokens exactly when these agree."""
    digests = data_digests(found).get(split) or []
    if not digests or None in digests:
        return ""
    return hashlib.sha256("\n".join(digests).encode()).hexdigest()
