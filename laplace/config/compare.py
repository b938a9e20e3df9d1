"""`compare:` and `mqar:`, the sections of the architecture comparison and its MQAR recall protocol
(compare/dvc.yaml, laplace/pipeline/compare*.py, laplace/evals/mqar_protocol.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from laplace.config.knobs import knob, log_range, non_negative, positive, unit_interval


def _arms(v):
    if not isinstance(v, dict) or not v:
        return "must be a mapping of arm names to model.* overrides"
    for name, over in v.items():
        if not isinstance(name, str) or not name.replace("-", "").replace("_", "").isalnum():
            return f"arm name {name!r} must be letters, digits, '-' or '_' (it names files and MLflow runs)"
        if not isinstance(over, dict):
            return f"arm {name!r} must be a mapping of model.* keys, got {over!r}"
    return None


def _dotted_overrides(v):
    if not isinstance(v, dict) or not all(isinstance(k, str) and "." in k for k in v):
        return "must map dotted keys (train.steps) to values"
    if any(k.startswith(("model.", "compare.")) for k in v):
        return "model.* belongs to the arms and compare.* to this section, not to the shared overrides"
    return None


@dataclass(frozen=True)
class CompareSection:
    """`compare:` the architecture comparison (compare/dvc.yaml, `laplace compare`): pure GLA, hybrids and a
    softmax model trained and measured on the same corpus, tokenizer, steps, seed and server settings.

    Each arm is its model.* overrides on top of params.yaml's model; everything else is params.yaml's, plus
    compare.overrides, for every arm alike."""

    arms: Any = knob(
        {
            "gla": {"preset": "tiny"},
            "hybrid-1in4": {"preset": "tiny-hybrid"},
            "hybrid-1in2": {"preset": "tiny", "attn": {"layers": [1, 3], "num_heads": 4}},
            "softmax": {"preset": "tiny-attn"},
            "gdn": {"preset": "tiny-gdn"},
            "gdn-hybrid": {"preset": "tiny-gdn-hybrid"},
        },
        _arms,
        "arm name -> its model.* overrides (model.attn: fla's AttentionSpec); adding one reruns only that arm",
    )
    overrides: Any = knob(
        {
            "train.steps": 70,
            "serve_check.workloads": ["poisson"],
            "serve_check.requests": 24,
            "probes.mqar_contexts": [64, 256],
            "probes.passkey_contexts": [256, 1024],
            "probes.passkey_depths": [0.5],
            "probes.recall_contexts": [256, 1024],
            "probes.memory_contexts": [1024],
            "probes.train_mqar": False,  # the arms' recall on MQAR is the protocol's (mqar.*), trained per arm there
        },
        _dotted_overrides,
        "settings every arm shares that differ from the main pipeline's (cut to what 2 cores run in minutes)",
    )
    memory_contexts: list[int] = knob(
        [1024, 8192, 32768], doc="serving bytes per sequence (recurrent state + K/V) measured from the engine at these"
    )
    decode_contexts: list[int] = knob(
        [1024, 2048, 8192], doc="decode time per token measured after prompts of these lengths"
    )
    decode_timing_steps: int = knob(24, positive, "decode steps timed at each of decode_contexts")
    table_contexts: list[int] = knob(
        [2048, 8192], doc="the table's decode ms per token columns (each one of decode_contexts)"
    )
    lm_eval_tasks: list[str] = knob(
        ["niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_cwe", "ruler_fwe"],
        doc="lm-evaluation-harness RULER tasks run on every arm (one that cannot run offline is reported, not run)",
    )
    lm_eval_limit: int = knob(4, positive, "samples per RULER task and length")
    lm_eval_lengths: list[int] = knob([1024], doc="RULER's max_seq_lengths")
    lm_eval_timeout_s: float = knob(
        600.0, positive, "a RULER task still running after this long is killed and reported as not run"
    )
    registry_prefix: str = knob(
        "laplace-compare", doc="each arm's export is registered as <this>-<family> (gla | hybrid | softmax)"
    )


def _distinct_positive(v):
    if (
        not isinstance(v, list)
        or not v
        or any(isinstance(x, bool) or not isinstance(x, (int, float)) or x <= 0 for x in v)
    ):
        return "must be a non-empty list of positive numbers"
    return "names a value twice" if len(set(v)) != len(v) else None


def _mqar_seeds(v):
    if not isinstance(v, list) or len(set(v)) < 3:
        return "needs at least 3 distinct seeds: the standard error across seeds is what a recall figure carries"
    return None


@dataclass(frozen=True)
class MqarSection:
    """`mqar:` the MQAR recall protocol of the comparison (compare/dvc.yaml: one `cell@ARM-WIDTH-LR-SEED` stage
    per cell, then `mqar`): Zoology's multi-query associative recall (arXiv 2312.04927), every (architecture,
    width) trained once per learning rate and seed, the best rate's accuracy reported with its error over
    seeds, behind a validity gate that first reproduces the known result."""

    arms: list[str] = knob(
        ["gla", "hybrid-1in4", "hybrid-1in2", "softmax", "gdn", "gdn-hybrid"],
        doc="the architectures: arms of compare.arms (each arm's attention layers at the same relative depth in "
        "mqar.layers layers; every arm needs its recall for the pick)",
    )
    widths: list[int] = knob(
        [16, 64],
        _distinct_positive,
        "model widths (d_model): every arm at each (the gate needs two for GLA; 16 and 64 hold 128 and 2,048 state "
        "floats, far enough apart for 3 seeds to tell)",
    )
    lrs: list[float] = knob(
        [0.0025, 0.005, 0.01],
        _distinct_positive,
        "the learning-rate grid (Muon's; AdamW's is this times adamw_lr_ratio): each (arm, width) trains at every "
        "one and reports the best, as Zoology does, so no arm runs at a rate tuned for another",
    )
    seeds: list[int] = knob([0, 1, 2], _mqar_seeds, doc="training seeds (initialisation and batches) of every cell")
    layers: int = knob(
        2,
        positive,
        "layers of every MQAR model (2: a hybrid is one GLA and one attention layer, both hybrids alike; 4 keeps "
        "a 1-in-4 and a 1-in-2 pattern apart at about 2.2x the time per step)",
    )
    heads: int = knob(2, positive, doc="GLA and attention heads of every MQAR model")
    gate_bias: float = knob(4.0, doc="GLA forget gates start near 1 (long memory)")
    gdn_dt_init: list[float] = knob(
        [0.0001, 0.001],
        log_range,
        "Gated DeltaNet layers' model.gdn.dt_init_range: dt log-uniform in it at init, so the decays start near 1 "
        "(long memory, as gate_bias for GLA; with fla's [0.001, 0.1] a small GDN stays at chance)",
    )
    vocab: int = knob(128, positive, doc="MQAR vocabulary: 48 key ids, 64 value ids (chance 1/64)")
    seq_len: int = knob(64, positive, doc="training sequence length (and the gate's reference context)")
    train_pairs: int = knob(16, positive, doc="each training batch mixes 1..this many key-value pairs")
    steps: int = knob(
        650,
        positive,
        "training steps of every cell (at 500 a width-64 GLA was mid-jump in one seed of 3 and the gate could not "
        "tell widths 32 and 64 apart; one cell is 10-30 s on 2 cores)",
    )
    batch_size: int = knob(16, positive, doc="sequences per training step")
    warmup_steps: int = knob(20, non_negative, doc="linear learning-rate warmup, then cosine to zero")
    adamw_lr_ratio: float = knob(1.0, positive, doc="AdamW's learning rate (embeddings, gates, norms) over Muon's")
    contexts: list[int] = knob([64], doc="test sequence lengths")
    pairs: list[int] = knob([4, 8, 16], doc="test key-value pair counts (a cell per length and count that fits)")
    test_queries: int = knob(
        1000,
        lambda v: None if v >= 1000 else f"must be >= 1000, got {v}: fewer cannot resolve a few points of accuracy",
        doc="at least this many test queries per (length, pairs) cell and seed (1,000 or more)",
    )
    test_seed: int = knob(1_000_003, doc="seeds the test sequences (the same for every model: paired comparisons)")
    reference_pairs: int = knob(
        16, positive, doc="the gate's reference cell: this many pairs at seq_len, which all-attention must solve"
    )
    attention_min: float = knob(0.99, unit_interval, doc="gate: all-attention's accuracy on the reference cell")
    significance_se: float = knob(
        2.0,
        positive,
        "a difference counts when it exceeds this many standard errors (seed spread included): the gate, the "
        "pick and the headline",
    )
