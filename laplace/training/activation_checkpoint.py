"""Activation checkpointing per block, as torchtitan applies it (train.activation_checkpoint).

- `none`: autograd keeps every tensor each block's backward needs.
- `full`: each block keeps only its input; its backward first reruns its forward.
- `selective`: each block keeps its input and the outputs of its projections (every
  `aten.mm` / `aten.addmm`: q, k, v, output gate, forget-gate low rank, o, and the MLP's
  gate, up and down), and recomputes the rest in backward: the norms, the short
  convolutions, SiLU, and the whole chunked GLA core. The projections are where the FLOPs
  are (O(T·D²)); the GLA core is O(T·C·K) per head with C the chunk size, but it is where
  most of the saved bytes are (its fp32 gates, decays and per-chunk score matrices), so this
  policy drops most of the memory for a small part of the recompute (bench/RESULTS.md).
  torchtitan's default keeps every second matmul as well; here the GLA core's batched
  matmuls (`aten.bmm`) are what it recomputes, and the projections are what it keeps.

Applied to each block before it is compiled and sharded (torchtitan's order: AC, then the
per-block compile, then FSDP2), so under `train.compile` the recompute lives inside the
compiled graph and the selective policy steers AOTAutograd's partitioner. The block's
forward is replaced by a non-reentrant `torch.utils.checkpoint.checkpoint` of itself
rather than wrapping the module, so parameter names (routing, checkpoints, exports) do not
change. The blocks draw no random numbers, so no RNG state is stashed for the recompute.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

MODES = ("none", "full", "selective")
# the block's projections: nn.Linear lowers to these (a batched matmul of the GLA core is aten.bmm)
SAVED_OPS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default})


def selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Keep the projections' outputs, recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(selective_policy)


def apply_activation_checkpointing(model: torch.nn.Module, mode: str) -> None:
    """Checkpoint every block of `model` (a LaplaceLM) in `mode` (one of MODES), in place."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing mode must be one of {MODES}, got {mode!r}")
    if mode == "none":
        return
    options = {"use_reentrant": False, "preserve_rng_state": False}
    if mode == "selective":
        options["context_fn"] = _selective_contexts
    checkpoint_fn = functools.partial(checkpoint, **options)  # the form Dynamo reads (torch's checkpoint_wrapper)
    for block in model.blocks:
        block.forward = _checkpointed(block.forward, checkpoint_fn)


def _checkpointed(forward, checkpoint_fn):
    # A function of ours calling the checkpoint: Dynamo starts tracing here (it skips frames in
    # torch's own files, so a bare partial as the forward would compile nothing) and turns the
    # checkpoint call into its higher-order op.
    def checkpointed_forward(*args, **kwargs):
        return checkpoint_fn(forward, *args, **kwargs)

    return checkpointed_forward
