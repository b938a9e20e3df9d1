"""`train:`, `adamw:` and `muon:`, the sections of the train stage (laplace/training, laplace/optim)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from laplace.config.knobs import fraction, knob, non_negative, positive, unit_interval


@dataclass(frozen=True)
class TrainSection:
    """`train:` the training run (train)."""

    steps: int = knob(300, positive, doc="optimizer steps")
    batch_size: int = knob(8, positive, "sequences per optimizer step, global across ranks")
    seq_len: int = knob(256, positive, doc="tokens per training sequence")
    grad_accum_steps: int = knob(
        1, positive, "micro-batches per optimizer step; each rank's share of batch_size is split into this many"
    )
    activation_checkpoint: Literal["none", "full", "selective"] = knob(
        "none",
        doc="none | full (recompute each block in backward) | selective (keep the projections' outputs)",
    )
    lr: float = knob(3e-3, positive, "AdamW learning rate (embeddings, head, norms, biases)")
    schedule: Literal["cosine", "wsd", "constant"] = knob("cosine", doc="cosine | wsd | constant")
    warmup_steps: int = knob(20, non_negative, doc="linear learning-rate warmup")
    min_lr_ratio: float = knob(
        0.1, lambda v: None if 0 <= v <= 1 else "must be in [0, 1]", doc="the schedule decays to lr * this"
    )
    decay_fraction: float = knob(0.2, unit_interval, "wsd: share of steps spent decaying")
    grad_clip: float = knob(1.0, non_negative, "0 disables clipping")
    precision: Literal["fp32", "bf16"] = knob(
        "fp32",
        doc="fp32 | bf16 (FSDP2 mixed precision: bf16 compute, fp32 reduction and master weights)",
    )
    compile: bool = knob(False, doc="torch.compile the training step")
    device: Literal["auto", "cpu", "cuda", "neuron"] = knob("auto", doc="auto | cpu | cuda | neuron")
    eval_every: int = knob(50, positive, doc="steps between validation losses")
    eval_batches: int = knob(8, positive, doc="validation batches per evaluation")
    checkpoint_every: int = knob(100, positive, doc="steps between checkpoints (DCP)")
    keep_checkpoints: int = knob(2, positive, doc="the newest this many checkpoints are kept")
    async_checkpoint: bool = knob(
        False, doc="true: DCP async_save, the write runs in the background while training goes on"
    )
    log_every: int = knob(10, positive, doc="steps between log lines")
    threads: int = knob(
        1,
        non_negative,
        (
            "intra-op threads of each training rank (torch.set_num_threads; OMP_NUM_THREADS of torchrun's"
            " ranks); 0 = torch's: one per core. 1 does not oversubscribe a shared machine (a step whose"
            " OpenMP threads wait for a descheduled sibling stalls); raise it on a quiet CPU with cores to spare"
        ),
    )
    nproc_per_node: int = knob(
        1, positive, "> 1: the train stage launches torchrun (gloo on CPU, nccl on CUDA, neuron on Trainium)"
    )
    nnodes: int = knob(1, positive, doc="machines in the job")
    node_rank: int = knob(0, non_negative, doc="this machine's rank among them")
    rdzv_endpoint: str = knob("", doc="host:port of the c10d rendezvous for several nodes; '' = --standalone")
    rdzv_id: str = knob("laplace", doc="rendezvous id shared by the nodes of one job")
    max_restarts: int = knob(0, non_negative, "torchrun restarts the job (from the last checkpoint) this often")


@dataclass(frozen=True)
class AdamWSection:
    """`adamw:` AdamW, for embeddings, head, norms and biases (train)."""

    betas: list[float] = knob([0.9, 0.95], doc="AdamW (beta1, beta2)")
    eps: float = knob(1e-8, positive, doc="AdamW epsilon")
    weight_decay: float = knob(0.1, non_negative, "applied to embeddings and head; never to norms/biases")


@dataclass(frozen=True)
class MuonSection:
    """`muon:` Muon, for the 2-D weight matrices (train)."""

    lr: float = knob(0.02, positive, doc="Muon learning rate (2-D weight matrices)")
    momentum: float = knob(0.95, fraction, doc="Muon momentum (the averaged form, as torch.optim.Muon)")
    nesterov: bool = knob(True, doc="Nesterov momentum")
    ns_steps: int = knob(5, lambda v: None if 0 < v < 100 else "must be in [1, 99]", doc="Newton-Schulz iterations")
    ns_coefficients: list[float] = knob([3.4445, -4.775, 2.0315], doc="Newton-Schulz quintic coefficients (a, b, c)")
    ns_dtype: Literal["auto", "bfloat16", "float32"] = knob(
        "auto",
        doc="Newton-Schulz arithmetic: bfloat16 (torch.optim.Muon's) | float32 | auto (bfloat16, "
        "except float32 on a CPU without native bf16 matmuls); the update is bf16 either way",
    )
    eps: float = knob(1e-7, positive, doc="added to the norm before Newton-Schulz")
    weight_decay: float = knob(0.0, non_negative, doc="decoupled weight decay of the Muon matrices")
    adjust_lr_fn: Literal["original", "match_rms_adamw"] = knob(
        "original", doc="original (scale by sqrt(max(1, rows/cols))) | match_rms_adamw (0.2 * sqrt(max(rows, cols)))"
    )
    comm: Literal["owner_reduce", "alltoall", "allgather"] = knob(
        "owner_reduce",
        doc="owner_reduce (gradients reduced straight to each matrix's owner, no exchange of its own; fp32, "
        "else alltoall) | alltoall (owner ranks, one all-to-all each way) | allgather (baseline)",
    )
