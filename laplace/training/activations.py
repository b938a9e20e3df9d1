"""Activation memory of one training micro-batch, measured with fake tensors (nothing allocated).

What autograd keeps for backward is read, not modelled: one block, and the embedding with
the final norm, head and loss, run forward on fake tensors (no memory, no FLOPs) under
`torch.autograd.graph.saved_tensors_hooks`, which sees every tensor saved for backward. A
formula would have to follow every intermediate of the chunked GLA core (its fp32 gates,
decays and score matrices); the hook follows the code as it is. Parameters are excluded
(they are counted as parameters); a storage saved twice counts once.

Peak activations of the step, per activation-checkpointing mode (laplace.training.
activation_checkpoint), L blocks, measured in the forward's dtype:
- none: L blocks' saved tensors + the outer part's (embedding indices, head and loss);
- full: each block keeps only its input; at the first block's backward its forward reruns,
  so the peak is L inputs + one block's saved tensors (or the outer part's, if larger);
- selective: each block keeps its input and its projections' outputs (the ops the policy
  saves, summed by a dispatch mode running the policy itself); the peak adds one block's
  recomputed rest.
Outside the saved tensors, the loss's backward allocates the logits' gradient (fp32 and
the compute dtype) for a moment: `logits_gradient`.

`measure_live_peak` is the check: the peak of live saved-tensor bytes during a real
forward and backward (tests/test_plan.py compares the two for a small preset).
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from laplace.model.config import ModelConfig
from laplace.model.lm import LaplaceLM
from laplace.training.activation_checkpoint import MODES, SAVED_OPS


def _storage_key(t: torch.Tensor):
    return StorageWeakRef(t.untyped_storage()).cdata


class SavedTensors:
    """Bytes saved for backward inside the context: unique storages, parameters left out."""

    def __init__(self, exclude=()):
        self.exclude = {_storage_key(p) for p in exclude}
        self.seen: dict[int, int] = {}

    def _pack(self, t: torch.Tensor):
        key = _storage_key(t)
        if key not in self.exclude:
            self.seen.setdefault(key, t.untyped_storage().nbytes())
        return t

    @property
    def bytes(self) -> int:
        return sum(self.seen.values())

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


class _PolicySaved(TorchDispatchMode):
    """Sums the output bytes of the ops the selective policy keeps."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in SAVED_OPS:
            self.bytes += out.untyped_storage().nbytes()
        return out


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # the trainer's cross_entropy (laplace.training.loop), restated to keep imports pointing down
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _probe_config(model_cfg: ModelConfig) -> tuple[ModelConfig, list[int]]:
    """A model with one block of each kind `model_cfg` has (GLA, Gated DeltaNet, and one per
    attention spec), and for each of its layers the probe block that stands for it."""
    specs = model_cfg.attn_specs
    kinds = ([None] if model_cfg.gla_layers else []) + (["gdn"] if model_cfg.gdn_layers else []) + specs
    probe_attn = [{**spec, "layers": [i]} for i, spec in enumerate(kinds) if isinstance(spec, dict)]
    probe_gdn = {**model_cfg.gdn_spec, "layers": [kinds.index("gdn")]} if model_cfg.gdn_layers else None
    probe = dataclasses.replace(model_cfg, n_layers=len(kinds), attn=probe_attn or None, gdn=probe_gdn)
    which = []
    gdn_layers = set(model_cfg.gdn_layers)
    for layer in range(model_cfg.n_layers):
        spec = model_cfg.attention_spec(layer)
        which.append(kinds.index(spec if spec is not None else "gdn" if layer in gdn_layers else None))
    return probe, which


def activation_bytes(model_cfg: ModelConfig, micro_batch: int, seq_len: int, dtype: torch.dtype) -> dict:
    """What one micro-batch of `micro_batch` x `seq_len` tokens keeps for backward, per mode,
    computed in `dtype` (bf16 under FSDP2 mixed precision): the parts and each mode's peak.
    A hybrid's attention blocks are measured apart from its GLA blocks: what they save grows with
    the sequence as scaled_dot_product_attention's backward needs (its fused kernels: O(T) per
    head; a materialised softmax: the O(T^2) probabilities)."""
    probe_cfg, which = _probe_config(model_cfg)
    with torch.device("meta"):
        model = LaplaceLM(probe_cfg).to(dtype)
    with FakeTensorMode(
        allow_non_fake_inputs=True
    ):  # meta storage, on the CPU as far as the code can tell (autocast checks it)
        model = model.to_empty(device="cpu")
        tokens = torch.zeros(micro_batch, seq_len, dtype=torch.long)
        x = torch.empty(micro_batch, seq_len, model.cfg.d_model, dtype=dtype, requires_grad=True)
        return _measure(model, model_cfg, which, tokens, x, dtype)


def _measure(model, model_cfg, which, tokens, x, dtype) -> dict:
    micro_batch, seq_len = tokens.shape
    kind_saved, kind_policy = [], []
    for block in model.blocks:
        with SavedTensors(exclude=model.parameters()) as saved:
            block(x)
        kind_saved.append(saved.bytes)
        with _PolicySaved() as policy:
            block(x)
        kind_policy.append(policy.bytes)
    with SavedTensors(exclude=model.parameters()) as saved:
        _loss(model._logits(model.embed(tokens)), tokens)
    outer = saved.bytes
    block_input = x.untyped_storage().nbytes()
    saved_per_layer = [kind_saved[k] for k in which]
    kept = {
        "none": saved_per_layer,
        "full": [block_input] * len(which),
        "selective": [block_input + kind_policy[k] for k in which],
    }
    peak = {"none": sum(saved_per_layer) + outer}
    for mode in ("full", "selective"):
        total = sum(kept[mode])
        # all blocks' kept tensors and the outer part, or at one block's backward its rerun forward
        rerun = max(total - k + s for k, s in zip(kept[mode], saved_per_layer))
        peak[mode] = max(total + outer, rerun)
    assert set(peak) == set(MODES)
    logits_grad = micro_batch * seq_len * model_cfg.vocab_size * (4 + torch.empty((), dtype=dtype).element_size())
    first = which[0] if which else 0
    attention = [k for i, k in enumerate(which) if model_cfg.attention_spec(i) is not None]
    gla = [k for i, k in enumerate(which) if model_cfg.attention_spec(i) is None]
    return {
        "micro_batch": micro_batch,
        "seq_len": seq_len,
        "block_saved_bytes": kind_saved[gla[0] if gla else first],
        "block_input_bytes": block_input,
        "block_projection_outputs_bytes": kind_policy[gla[0] if gla else first],
        "attention_block_saved_bytes": [kind_saved[k] for k in sorted(set(attention))],
        "attention_layers": len(attention),
        "outer_saved_bytes": outer,
        "kept_per_block_bytes": {mode: max(v) for mode, v in kept.items()},
        "peak_bytes": peak,
        "logits_gradient_bytes": logits_grad,
    }


def measure_live_peak(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> int:
    """The peak of saved-tensor bytes alive during a real forward, loss and backward of `model`:
    each saved tensor is held through a handle that autograd frees when its node has run, and
    a storage counts while any handle to it lives. Parameters are left out."""
    params = {_storage_key(p) for p in model.parameters()}
    holders: dict[int, int] = {}
    sizes: dict[int, int] = {}
    state = {"live": 0, "peak": 0}

    class Handle:
        __slots__ = ("tensor", "__weakref__")

        def __init__(self, tensor):
            self.tensor = tensor

    def release(key):
        holders[key] -= 1
        if not holders[key]:
            state["live"] -= sizes[key]

    def pack(t):
        key = _storage_key(t)
        if key in params:
            return t
        if not holders.get(key):
            sizes[key] = t.untyped_storage().nbytes()
            state["live"] += sizes[key]
            state["peak"] = max(state["peak"], state["live"])
        holders[key] = holders.get(key, 0) + 1
        handle = Handle(t)
        weakref.finalize(handle, release, key)
        return handle

    def unpack(h):
        return h.tensor if isinstance(h, Handle) else h

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        loss = _loss(model(tokens), targets)
    loss.backward()
    return state["peak"]
