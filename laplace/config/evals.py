"""`numerics:` and `probes:`, the sections of the numerics and probes stages (laplace/evals)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from laplace.config.knobs import knob, log_range, non_negative, positive, unit_interval


@dataclass(frozen=True)
class NumericsSection:
    """`numerics:` eager vs compiled vs fp64 on the exported model (numerics)."""

    mode: Literal["compare", "eager"] = knob(
        "compare", doc="compare | eager (also prove two eager runs are bit-identical)"
    )
    precisions: list[str] = knob(
        ["fp32", "bf16"],
        lambda v: (
            None
            if v and len(set(v)) == len(v) and set(v) <= {"fp32", "bf16"}
            else "must name fp32, bf16 or both, each once"
        ),
        doc="checked precisions: fp32 (compiled within fp32_rel_rms_max of fp64) and bf16 (compiled no worse than "
        "eager); each compiles its own prefill, decode and training-step graphs",
    )
    train_step: bool = knob(
        True,
        doc="also check one training step's gradients (compiled vs eager vs fp64); false skips compiling the "
        "training graphs (their forward and backward), for a pilot that only serves the export",
    )
    batch_size: int = knob(4, positive, "held-out sequences per check")
    seq_len: int = knob(128, positive, "prefill / training-step length")
    greedy_prompts: int = knob(4, positive, doc="prompts decoded greedily, compiled vs eager")
    greedy_tokens: int = knob(32, positive, doc="tokens decoded greedily after each")
    prompt_tokens: int = knob(32, positive, doc="prompt length of the decode-step comparison")
    decode_tokens: int = knob(8, positive, "tokens decoded after each prompt in the decode-step comparison")
    margin: float = knob(
        0.5, non_negative, "top-1 agreement also reported on positions with fp64 top1-top2 gap >= margin"
    )
    fp32_rel_rms_max: float = knob(1e-5, positive, "gate: fp32 compiled vs fp64 relative RMS of logits")
    fp32_top1_min: float = knob(1.0, unit_interval, "gate: fp32 compiled vs eager top-1 agreement")
    bf16_error_ratio_max: float = knob(1.5, positive, "gate: bf16 compiled error vs fp64 <= this x eager's")
    bf16_top1_min: float = knob(0.99, unit_interval, "gate: bf16 top-1 agreement with fp64 on clear-margin positions")
    grad_rel_rms_fp32_max: float = knob(1e-4, positive, "gate: fp32 compiled training-step gradients vs fp64")
    seed: int = knob(0, doc="seeds the held-out windows")


@dataclass(frozen=True)
class ProbesSection:
    """`probes:` retrieval probes and memory accounting (probes)."""

    mqar_contexts: list[int] = knob([64, 256, 1024], doc="MQAR sequence lengths")
    mqar_pairs: list[int] = knob([4, 8, 16], doc="key-value pairs per sequence")
    mqar_samples: int = knob(32, positive, "sequences per (context, pairs) cell")
    paths_agree_min: float = knob(
        0.99, unit_interval, "gate: MQAR argmax agreement of the serving path and the eager forward"
    )
    passkey_contexts: list[int] = knob([256, 1024, 4096], doc="passkey prompt lengths")
    passkey_depths: list[float] = knob([0.1, 0.5, 0.9], doc="where the passkey sits, as a fraction of the context")
    passkey_samples: int = knob(2, positive, doc="prompts per (context, depth) cell")
    recall_contexts: list[int] = knob(
        [256, 1024, 4096],
        doc="NIAH (single key, multi-key, multi-value) prompt lengths; train.seq_len and 4 x train.seq_len "
        "(the length the model was trained at, and beyond it) are added where not below the shortest of these",
    )
    recall_samples: int = knob(4, positive, doc="NIAH prompts per (task, length); they decode together")
    memory_contexts: list[int] = knob([1024, 4096, 16384, 32768], doc="decode memory measured after these")
    kv_contexts: list[int] = knob(
        [2048, 8192, 32768], doc="contexts at which a transformer's KV-cache bytes are reported beside the GLA state"
    )
    train_mqar: bool = knob(True, doc="train a small GLA on MQAR so the probe is seen to measure something")
    mqar_train_steps: int = knob(600, positive, doc="learning is a sudden jump after ~150-250 steps")
    mqar_train_d_model: int = knob(128, positive, doc="hidden size of the MQAR model")
    mqar_train_layers: int = knob(2, positive, doc="its layers")
    mqar_train_heads: int = knob(2, positive, doc="its heads")
    mqar_train_gate_bias: float = knob(4.0, doc="forget gates start near 1 (long memory)")
    mqar_train_gdn_dt_init: list[float] = knob(
        [0.0001, 0.001],
        log_range,
        doc="Gated DeltaNet layers' model.gdn.dt_init_range (decays start near 1: long memory, as the gate bias)",
    )
    mqar_train_vocab: int = knob(
        64,
        positive,
        (
            "MQAR training vocabulary: 24 key ids, 32 value ids, so chance is 1/32 "
            "(a larger one stays on the plateau longer)"
        ),
    )
    mqar_train_seq_len: int = knob(64, positive, doc="its sequence length")
    mqar_train_pairs: int = knob(8, positive, "the hardest pair count sampled during MQAR training")
    mqar_train_batch_size: int = knob(16, positive, "small batches reach the jump in accuracy soonest on a CPU")
    mqar_train_lr: float = knob(5e-3, positive, "AdamW learning rate of the MQAR model")
    mqar_train_muon_lr: float = knob(0.02, positive, doc="Muon learning rate of the MQAR model")
    mqar_train_warmup_steps: int = knob(20, non_negative, doc="its learning-rate warmup")
    seed: int = knob(0, doc="seeds the probe samples and the MQAR model")
