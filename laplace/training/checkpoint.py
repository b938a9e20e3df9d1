"""Training checkpoints: torch.distributed.checkpoint in safetensors, written atomically, verified.

Layout of one checkpoint (runs/train/checkpoints/step_000100/):
    shard-0000R-model-00001-of-00001.safetensors   one file per rank (DCP's safetensors storage):
                                                    that rank's row shards of the parameters
                                                    ("model.*") and of the optimizer state
                                                    ("optim.state.*": Muon momentum, AdamW moments)
    trainer.json                                    step, history, run fingerprint, world size
    manifest.json                                   sizes and sha256 of the files above, written last
                                                    (laplace.manifest, as for data and exports)

What is saved comes from torch.distributed.checkpoint.state_dict (`get_state_dict`): the
FSDP2 model's DTensor parameters and each optimizer's own state, keyed by parameter
name. A load at another world size reads the saved shards into the new sharding (DCP
does it; no project code) and `set_state_dict` hands the optimizers their real state.
Only tensors are stored: the optimizers' hyperparameters come from the params of the
run, which the fingerprint in trainer.json pins.

Every rank writes into one hidden staging directory and hashes its own shard files; rank 0
then writes trainer.json and the manifest, fsyncs and renames the directory into place
(`Checkpointer`; with `train.async_checkpoint` the write runs in the background and the
rename follows at the first step boundary after every rank's write is done). Resuming, rank 0
proposes the newest checkpoint by step number and every rank verifies its share of the files:
the newest that verifies everywhere wins, a damaged one is skipped with a warning naming the
file. Nothing is unpickled: DCP's safetensors storage keeps its metadata in the safetensors
headers.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from laplace import manifest
from laplace.errors import Failure
from laplace.fileio import atomic_write_json, replace_dir

log = logging.getLogger(__name__)

KIND = "checkpoint"
STEP_DIR = re.compile(r"^step_(\d{6,})$")


class CheckpointError(Failure):
    """A checkpoint that cannot be written (a full disk) or read (damaged): one line, exit 1.
    Not bad input (exit 2 means params, data or a gate): a retry succeeds once space is freed."""


@dataclass
class Checkpoint:
    path: Path
    step: int
    model: dict[str, torch.Tensor]
    trainer: dict[str, Any]


def verify_manifest(directory: Path) -> tuple[bool, str]:
    """(ok, reason): the checkpoint's manifest is complete and every file matches it."""
    return manifest.verify(directory, KIND)


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Completed checkpoint directories, newest first (staging directories are ignored)."""
    root = Path(root)
    if not root.exists():
        return []
    found = []
    for p in root.iterdir():
        m = STEP_DIR.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found, reverse=True)


def prune_checkpoints(root: Path, keep: int) -> None:
    for _, p in list_checkpoints(root)[keep:]:
        shutil.rmtree(p, ignore_errors=True)
    for p in Path(root).glob(".step_*.partial*"):
        shutil.rmtree(p, ignore_errors=True)  # leftovers of killed writes


def stored_tensors(path: Path, prefix: str) -> dict[str, torch.Tensor]:
    """Whole tensors whose key starts with `prefix`, assembled from every rank's shards by DCP
    (in this process, no process group needed)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    reader = HuggingFaceStorageReader(str(path))
    metadata = reader.read_metadata().state_dict_metadata
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.items()
        if key.startswith(prefix)
    }
    if state:
        with warnings.catch_warnings():  # DCP warns that it loads in one process: that is the point
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load(state, storage_reader=HuggingFaceStorageReader(str(path)), no_dist=True)
    return {key[len(prefix) :]: t for key, t in state.items()}


def model_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The parameters stored in a checkpoint, whole (for export and inspection)."""
    out = stored_tensors(path, "model.")
    if not out:
        raise CheckpointError(f"{path}: holds no parameters")
    return out


def load_checkpoint(path: Path) -> Checkpoint:
    """A verified checkpoint's parameters and trainer record (for export and inspection)."""
    ok, reason = verify_manifest(path)
    if not ok:
        raise CheckpointError(reason)
    trainer = json.loads((Path(path) / "trainer.json").read_text())
    return Checkpoint(path=Path(path), step=int(trainer["step"]), model=model_tensors(path), trainer=trainer)


def latest_checkpoint(root: Path) -> Checkpoint | None:
    """The newest checkpoint that verifies; damaged ones are skipped with a warning."""
    for _, path in list_checkpoints(root):
        try:
            return load_checkpoint(path)
        except (CheckpointError, OSError, ValueError, KeyError) as exc:
            log.warning("skipping damaged checkpoint %s: %s", path, exc)
    return None


# --------------------------------------------------------------------------- sharded (DCP)
#
# Distributed training checkpoints go through torch.distributed.checkpoint with its
# safetensors storage (HuggingFaceStorageWriter/Reader): every rank writes its own
# shard file and the metadata lives in the safetensors headers (no pickle). The staging
# directory, manifest and rename around it are the same as above.


def _state(model, optimizers) -> tuple[dict[str, torch.Tensor], dict]:
    """(the tensors DCP saves and loads, the optimizers' flattened state dict). Optimizer state
    is created first if the optimizers have not stepped yet (a step at lr 0 on zero gradients:
    collective, every rank calls this)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizers, options=StateDictOptions(flatten_optimizer_state_dict=True))
    tensors = {f"model.{k}": v for k, v in model_sd.items()}
    tensors.update({f"optim.{k}": v for k, v in optim_sd.items() if isinstance(v, torch.Tensor)})
    return tensors, optim_sd


def _root_cause(exc: BaseException) -> str:
    """The first line of the error underneath DCP's per-rank wrapper (e.g. the OSError of a full disk)."""
    failures = getattr(exc, "failures", None)  # torch.distributed.checkpoint's CheckpointException
    if failures:
        first = next(iter(failures.values()))
        exc = first[0] if isinstance(first, tuple) else first
    while exc.__cause__ is not None and not isinstance(exc, OSError):
        exc = exc.__cause__
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _own_shards(staging: Path, rank: int) -> list[Path]:
    """The files DCP's safetensors writer wrote for `rank` (shard-0000{rank+1}-...)."""
    return sorted(staging.glob(f"shard-{rank + 1:05d}-*"))


def _digests_file(staging: Path, rank: int) -> Path:
    return staging / f".digests-rank{rank:05d}.json"


def _hash_own_shards(staging: Path, rank: int) -> None:
    """Each rank hashes the files it wrote, all ranks at once (not rank 0 every file), and leaves
    the entries beside them for rank 0's manifest."""
    entries = {p.name: manifest.describe(p) for p in _own_shards(staging, rank)}
    atomic_write_json(_digests_file(staging, rank), entries)


@dataclass
class _Pending:
    step: int
    staging: Path
    final: Path
    trainer: dict[str, Any]
    done: Any  # a concurrent.futures.Future of the rank's DCP write and hashing (async), or None


class Checkpointer:
    """Collective: every rank calls it. Writes checkpoints atomically under `root`: ranks write
    into a hidden staging directory, each hashes its own shard files, rank 0 writes trainer.json
    and the manifest (from the ranks' digests), fsyncs and renames the directory into place.

    `asynchronous`: DCP's async_save stages the state in host memory and writes it in a
    background thread, so training goes on; the rename happens in `finish`, which the first step
    boundary after every rank's write is done calls (`finish_if_written`), as do the next save,
    the end of training and a stop (nothing half written is ever in place). Its
    collectives run on a gloo group of their own, as DCP asks, apart from the training's.

    A failed write (a full disk, a write error on any rank) removes the staging directory,
    leaves every earlier checkpoint as it was and raises a one-line CheckpointError on every rank."""

    def __init__(self, root: Path, keep: int, device: torch.device, asynchronous: bool = False):
        self.root, self.keep, self.device, self.asynchronous = Path(root), keep, device, asynchronous
        self._pending: _Pending | None = None
        self._group = None  # the async writes' process group
        self._hasher = None  # one background thread: the DCP write, then the hashing

    def save(self, step: int, model, optimizers, trainer: dict[str, Any]) -> Path:
        """Write checkpoint `step`; returns its final path (in place once `finish` returns, which
        this call does itself unless asynchronous)."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageWriter

        self.finish()  # one write at a time: the previous one is renamed into place first
        final = self.root / f"step_{step:06d}"
        staging = self.root / f".step_{step:06d}.partial"
        rank = dist.get_rank()
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)  # a killed writer's leftovers
            staging.mkdir(parents=True)
        dist.barrier()
        pending = _Pending(step, staging, final, json.loads(json.dumps(trainer)), None)  # a copy: history grows
        error = ""
        try:
            tensors, _ = _state(model, optimizers)
            writer = HuggingFaceStorageWriter(str(staging), save_distributed=True)
            if self.asynchronous:
                from concurrent.futures import ThreadPoolExecutor

                if self._group is None:
                    self._group = dist.new_group(backend="gloo")
                    self._hasher = ThreadPoolExecutor(1, thread_name_prefix="laplace-checkpoint")
                written = dcp.async_save(tensors, storage_writer=writer, process_group=self._group)
                pending.done = self._hasher.submit(lambda: (written.result(), _hash_own_shards(staging, rank)))
            else:
                dcp.save(tensors, storage_writer=writer)
                _hash_own_shards(staging, rank)
        except (Exception, _checkpoint_exception()) as exc:  # DCP gathers every rank's failure
            error = _root_cause(exc)
        self._pending = pending
        if error or not self.asynchronous:
            self.finish(error)
        return final

    def finish_if_written(self) -> Path | None:
        """Collective, at every step boundary: an async write that every rank has finished is put in
        place now, not at the next save, so a crash loses at most one checkpoint interval. One
        all-reduce of one integer, and only while a write is pending (every rank has one then:
        saves are collective). Returns the path put in place, or None."""
        if self._pending is None or self._pending.done is None:
            return None
        from laplace.training.distributed import all_min_int

        if all_min_int(int(self._pending.done.done()), self.device):
            return self.finish()
        return None

    def finish(self, error: str = "") -> Path | None:
        """Collective: wait for the pending write, then put it in place. Returns its path (None
        when nothing was pending)."""
        import torch.distributed as dist

        pending, self._pending = self._pending, None
        if pending is None:
            return None
        if pending.done is not None and not error:
            try:
                pending.done.result()
            except (Exception, _checkpoint_exception()) as exc:
                error = _root_cause(exc)
        dist.barrier()  # every rank's shards and digests are on disk
        rank = dist.get_rank()
        if rank == 0 and not error:
            try:
                known: dict[str, dict] = {}
                for r in range(dist.get_world_size()):
                    known.update(json.loads(_digests_file(pending.staging, r).read_text()))
                    _digests_file(pending.staging, r).unlink()
                info = {**pending.trainer, "step": pending.step, "world_size": dist.get_world_size()}
                atomic_write_json(pending.staging / "trainer.json", info)
                manifest.write_manifest(pending.staging, KIND, known=known, step=pending.step)
                replace_dir(pending.staging, pending.final)
            except (OSError, ValueError) as exc:
                error = f"{type(exc).__name__}: {exc}"
        failed = _broadcast_int(1 if error else 0, self.device)  # rank 0's finalisation decides for everyone
        if failed:
            if rank == 0:
                shutil.rmtree(pending.staging, ignore_errors=True)
            previous = list_checkpoints(self.root)
            kept = f"the previous checkpoint {previous[0][1].name} is intact" if previous else "no earlier checkpoint"
            raise CheckpointError(
                f"could not write checkpoint {pending.final.name} in {self.root}: {error or 'failed on rank 0'}; {kept}"
            )
        if rank == 0:
            prune_checkpoints(self.root, self.keep)
        dist.barrier()
        return pending.final

    def close(self) -> None:
        """Finish what is pending (collective) and stop the background thread."""
        try:
            self.finish()
        finally:
            if self._hasher is not None:
                self._hasher.shutdown(wait=True)
                self._hasher = None


def _checkpoint_exception():
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    return CheckpointException


def _broadcast_int(value: int, device: torch.device) -> int:
    from laplace.training.distributed import broadcast_int

    return broadcast_int(value, device)


def save_sharded(
    root: Path, step: int, model, optimizers, trainer: dict[str, Any], keep: int, device: torch.device
) -> Path:
    """Collective: write checkpoint `step` under `root` now (Checkpointer, synchronous)."""
    return Checkpointer(root, keep, device).save(step, model, optimizers, trainer)


def load_sharded(path: Path, model, optimizers) -> dict[str, Any]:
    """Collective: fill the model's shards and the optimizers' state from checkpoint `path`, at
    whatever world size it was saved."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    tensors, optim_sd = _state(model, optimizers)
    with torch.no_grad():
        dcp.load(tensors, storage_reader=HuggingFaceStorageReader(str(path)))
    model_sd = {k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")}
    loaded = {k[len("optim.") :]: v for k, v in tensors.items() if k.startswith("optim.")}
    # hyperparameters (lr, betas, ...) are not stored: the running optimizers' are the run's
    loaded.update({k: v for k, v in optim_sd.items() if not isinstance(v, torch.Tensor)})
    set_state_dict(
        model,
        optimizers,
        model_state_dict=model_sd,
        optim_state_dict=loaded,
        options=StateDictOptions(flatten_optimizer_state_dict=True),
    )
    return json.loads((Path(path) / "trainer.json").read_text())


def _verify_share(path: Path, rank: int, world: int) -> str:
    """This rank's part of a checkpoint's verification: the manifest, and the sizes and sha256 of
    every world-th file from `rank` on ("" when they match). Ranks hash in parallel."""
    listed, reason = manifest.read_manifest(path, KIND)
    if listed is None:
        return reason
    for name in sorted(listed["files"])[rank::world]:
        if reason := manifest.verify_file(path, name, listed["files"][name]):
            return reason
    return ""


def latest_verified(root: Path, device: torch.device) -> Path | None:
    """Collective: the newest checkpoint that every rank sees and verifies. Rank 0 lists the
    checkpoints and proposes them newest first by step number (broadcast), so a rank whose own
    listing of shared storage is stale or holds another directory still opens the same step;
    every rank hashes its share of the files; a damaged one is skipped with a warning."""
    import torch.distributed as dist

    from laplace.training.distributed import all_min_int, broadcast_int

    rank, world = dist.get_rank(), dist.get_world_size()
    candidates = [step for step, _ in list_checkpoints(root)] if rank == 0 else []
    while True:  # rank 0 drives: its next candidate, or -1 when none is left
        step = broadcast_int(candidates.pop(0) if candidates else -1, device)
        if step < 0:
            return None
        path = Path(root) / f"step_{step:06d}"
        reason = _verify_share(path, rank, world)
        if all_min_int(0 if reason else 1, device):
            return path
        if reason:
            log.warning("skipping damaged checkpoint %s (rank %d): %s", path, rank, reason)
