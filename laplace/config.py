"""Typed, validated configuration sections: every knob, with its default, check and doc.

`config_from_dict()` builds frozen dataclasses from a params mapping; any unknown key,
wrong type or impossible value raises `ConfigError` with a one-line message naming the
key. This module knows nothing of stages or tracking, so the library may import it; reading
params.yaml and applying `--set` overrides live in `laplace.pipeline.params`. The one file it
reads is the one a knob names as the model: model.init's config.json (init_model_config: the
architecture of an import, which its weights decide); paths are otherwise checked lexically.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from laplace.errors import ConfigError
from laplace.model.config import PRESETS, RUNTIME_FIELDS, ModelConfig, preset_model_config, validate_model_config

__all__ = ["Config", "ConfigError", "ModelConfig", "config_from_dict", "default_params", "knob", "knob_docs"]


# --------------------------------------------------------------------------- checks


def _positive(v):
    return None if v > 0 else "must be > 0"


def _non_negative(v):
    return None if v >= 0 else "must be >= 0"


def _fraction(v):
    return None if 0.0 <= v < 1.0 else "must be in [0, 1)"


def _unit_interval(v):
    return None if 0.0 < v <= 1.0 else "must be in (0, 1]"


def _power_of_two(v):
    return None if v > 0 and (v & (v - 1)) == 0 else "must be a power of two"


def knob(default, check=None, doc: str = "", key: str | None = None):
    """A config field with a default, an optional value check and a docstring. `key`: its name in
    params.yaml where that is not a Python identifier (`tokenizer.from`, a keyword)."""
    metadata = {"check": check, "doc": doc, "key": key}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def yaml_key(f: dataclasses.Field) -> str:
    """A field's key in params.yaml (its Python name unless the knob says otherwise)."""
    return f.metadata.get("key") or f.name


# knobs that were renamed: the old key's error names the new one
RENAMED = {"tokenizer.path": "tokenizer.from"}


# --------------------------------------------------------------------------- sections


def _model_section() -> type:
    """`model:` in params.yaml: a preset plus one knob per ModelConfig field, built from ModelConfig's
    own fields and docs (so a new field is a knob at once). An architecture knob left empty (null)
    takes the preset's value; a runtime field (RUNTIME_FIELDS: kernel) defaults to ModelConfig's."""
    hints = typing.get_type_hints(ModelConfig)
    fields: list[tuple[str, Any, Any]] = [
        (
            "preset",
            str,
            knob("tiny", doc=" | ".join(PRESETS) + "; the keys below override the preset (empty = the preset's)"),
        ),
        (
            "init",
            str,
            knob(
                "",
                doc="an export or `laplace import` directory to fine-tune from (its architecture and weights; "
                "the keys below must then agree with it or stay empty); empty: a random init",
            ),
        ),
    ]
    for f in dataclasses.fields(ModelConfig):
        doc = f.metadata.get("doc", "")
        if f.name in RUNTIME_FIELDS:
            fields.append((f.name, hints[f.name], knob(f.default, doc=doc)))
        else:
            fields.append((f.name, hints[f.name] | None, knob(None, doc=doc)))
    section = dataclasses.make_dataclass("ModelSection", fields, frozen=True)
    section.__module__ = __name__
    section.__doc__ = "`model:` the architecture: a preset, and one key per ModelConfig field (overrides of the preset)"
    return section


ModelSection = _model_section()


@dataclass(frozen=True)
class DataSection:
    """`data:` the corpus and how it is cut into documents, split and sliced (corpus, tokenize)."""

    source: Literal["python-docs", "files", "hub"] = knob(
        "python-docs",
        doc="python-docs (offline default) | files (data.path) | hub (a Hugging Face dataset, streamed)",
    )
    path: str = knob(
        "data/python-docs",
        lambda v: None if v.strip() else "must name a file or directory",
        (
            "the corpus: a directory (walked, sorted) or one file; tokenize's DVC "
            "dependency (dvc.yaml). python-docs reads it when present (the corpus "
            "stage writes it), else the Python install. Your own: put it in "
            "data/raw, `dvc add data/raw`, set source: files and path: data/raw"
        ),
    )
    hub_path: str = knob(
        "HuggingFaceFW/fineweb-edu", doc="a hub dataset, or a local dataset directory (save_to_disk, JSONL/Parquet)"
    )
    hub_name: str = knob("sample-10BT", doc="the hub dataset's configuration (subset)")
    hub_split: str = knob("train", doc="the split to stream")
    text_field: str = knob("text", doc="the text column of .jsonl/.json/.parquet records and datasets")
    max_documents: int = knob(0, _non_negative, "0 = no cap; else shared evenly among the slices")
    max_tokens: int = knob(0, _non_negative, "train tokens, 0 = no cap; else shared evenly among the slices")
    min_chars: int = knob(64, _positive, "shorter documents are skipped and counted")
    max_document_chars: int = knob(
        1_000_000, _positive, "longer text files and records are cut at blank lines (or at this size) into documents"
    )
    max_record_bytes: int = knob(
        512_000_000,
        _positive,
        "a longer JSON line (or .json file) is skipped, named and counted; a worker holds about 2x a record",
    )
    split_bytes: int = knob(
        32_000_000, _positive, "a larger .jsonl or text file is split by byte ranges (at line starts) over slices"
    )
    val_fraction: float = knob(
        0.05, _fraction, doc="share of documents held out for validation (by a seeded hash of the text)"
    )
    on_bad_file: Literal["skip", "error"] = knob(
        "skip", doc="undecodable or binary input: skip (each logged by name) | error"
    )
    slices: int = knob(
        16, _positive, "input slices (files hashed by path, hub shards): the unit of parallel work and of reuse"
    )
    shard_tokens: int = knob(100_000_000, _positive, "tokens per shard file (the last shard of each slice is shorter)")
    num_proc: int = knob(
        2, _positive, "tokenize worker processes: the local pool's, or a LocalCluster's (executor: dask, no address)"
    )
    executor: Literal["local", "dask"] = knob(
        "local",
        doc="where tokenize's slices run (survey, sample, encode): local (a process pool) | dask (a Dask cluster; "
        "every worker must see the project directory)",
    )
    dask_address: str = knob(
        "", doc="executor: dask: a running scheduler (tcp://HOST:8786); empty = a LocalCluster of data.num_proc workers"
    )
    dask_in_flight: int = knob(
        256, _positive, "executor: dask: slices submitted to the scheduler at a time (its memory stays bounded)"
    )


@dataclass(frozen=True)
class TokenizerSection:
    """`tokenizer:` the byte-level BPE (tokenize)."""

    vocab_size: int = knob(
        4096,
        lambda v: None if v >= 260 else "must be >= 260 (256 bytes + specials)",
        doc="a size the sample cannot reach is an error naming the size it reached",
    )
    min_frequency: int = knob(2, _positive, doc="BPE merges seen fewer times are dropped")
    sample_bytes: int = knob(
        100_000_000, _positive, "the BPE trains on a seeded sample of at most this many bytes of train documents"
    )
    from_: str = knob(
        "",
        doc="a given tokenizer: a tokenizer.json, or a directory holding one (a `laplace import` or an export), "
        "used as is with its BOS/EOS conventions; empty = train a byte-level BPE",
        key="from",
    )


@dataclass(frozen=True)
class TrainSection:
    """`train:` the training run (train)."""

    steps: int = knob(300, _positive, doc="optimizer steps")
    batch_size: int = knob(8, _positive, "sequences per optimizer step, global across ranks")
    seq_len: int = knob(256, _positive, doc="tokens per training sequence")
    grad_accum_steps: int = knob(
        1, _positive, "micro-batches per optimizer step; each rank's share of batch_size is split into this many"
    )
    activation_checkpoint: Literal["none", "full", "selective"] = knob(
        "none",
        doc="none | full (recompute each block in backward) | selective (keep the projections' outputs)",
    )
    lr: float = knob(3e-3, _positive, "AdamW learning rate (embeddings, head, norms, biases)")
    schedule: Literal["cosine", "wsd", "constant"] = knob("cosine", doc="cosine | wsd | constant")
    warmup_steps: int = knob(20, _non_negative, doc="linear learning-rate warmup")
    min_lr_ratio: float = knob(
        0.1, lambda v: None if 0 <= v <= 1 else "must be in [0, 1]", doc="the schedule decays to lr * this"
    )
    decay_fraction: float = knob(0.2, _unit_interval, "wsd: share of steps spent decaying")
    grad_clip: float = knob(1.0, _non_negative, "0 disables clipping")
    precision: Literal["fp32", "bf16"] = knob(
        "fp32",
        doc="fp32 | bf16 (FSDP2 mixed precision: bf16 compute, fp32 reduction and master weights)",
    )
    compile: bool = knob(False, doc="torch.compile the training step")
    device: Literal["auto", "cpu", "cuda", "neuron"] = knob("auto", doc="auto | cpu | cuda | neuron")
    eval_every: int = knob(50, _positive, doc="steps between validation losses")
    eval_batches: int = knob(8, _positive, doc="validation batches per evaluation")
    checkpoint_every: int = knob(100, _positive, doc="steps between checkpoints (DCP)")
    keep_checkpoints: int = knob(2, _positive, doc="the newest this many checkpoints are kept")
    async_checkpoint: bool = knob(
        False, doc="true: DCP async_save, the write runs in the background while training goes on"
    )
    log_every: int = knob(10, _positive, doc="steps between log lines")
    threads: int = knob(
        1,
        _non_negative,
        (
            "intra-op threads of each training rank (torch.set_num_threads; OMP_NUM_THREADS of torchrun's"
            " ranks); 0 = torch's: one per core. 1 does not oversubscribe a shared machine (a step whose"
            " OpenMP threads wait for a descheduled sibling stalls); raise it on a quiet CPU with cores to spare"
        ),
    )
    nproc_per_node: int = knob(
        1, _positive, "> 1: the train stage launches torchrun (gloo on CPU, nccl on CUDA, neuron on Trainium)"
    )
    nnodes: int = knob(1, _positive, doc="machines in the job")
    node_rank: int = knob(0, _non_negative, doc="this machine's rank among them")
    rdzv_endpoint: str = knob("", doc="host:port of the c10d rendezvous for several nodes; '' = --standalone")
    rdzv_id: str = knob("laplace", doc="rendezvous id shared by the nodes of one job")
    max_restarts: int = knob(0, _non_negative, "torchrun restarts the job (from the last checkpoint) this often")


@dataclass(frozen=True)
class AdamWSection:
    """`adamw:` AdamW, for embeddings, head, norms and biases (train)."""

    betas: list[float] = knob([0.9, 0.95], doc="AdamW (beta1, beta2)")
    eps: float = knob(1e-8, _positive, doc="AdamW epsilon")
    weight_decay: float = knob(0.1, _non_negative, "applied to embeddings and head; never to norms/biases")


@dataclass(frozen=True)
class MuonSection:
    """`muon:` Muon, for the 2-D weight matrices (train)."""

    lr: float = knob(0.02, _positive, doc="Muon learning rate (2-D weight matrices)")
    momentum: float = knob(0.95, _fraction, doc="Muon momentum (the averaged form, as torch.optim.Muon)")
    nesterov: bool = knob(True, doc="Nesterov momentum")
    ns_steps: int = knob(5, lambda v: None if 0 < v < 100 else "must be in [1, 99]", doc="Newton-Schulz iterations")
    ns_coefficients: list[float] = knob([3.4445, -4.775, 2.0315], doc="Newton-Schulz quintic coefficients (a, b, c)")
    eps: float = knob(1e-7, _positive, doc="added to the norm before Newton-Schulz")
    weight_decay: float = knob(0.0, _non_negative, doc="decoupled weight decay of the Muon matrices")
    adjust_lr_fn: Literal["original", "match_rms_adamw"] = knob(
        "original", doc="original (scale by sqrt(max(1, rows/cols))) | match_rms_adamw (0.2 * sqrt(max(rows, cols)))"
    )
    comm: Literal["owner_reduce", "alltoall", "allgather"] = knob(
        "owner_reduce",
        doc="owner_reduce (gradients reduced straight to each matrix's owner, no exchange of its own; fp32, "
        "else alltoall) | alltoall (owner ranks, one all-to-all each way) | allgather (baseline)",
    )


@dataclass(frozen=True)
class GenerateSection:
    """`generate:` laplace generate, and the logged MLflow model's defaults (track)."""

    prompt: str = knob("The function", doc="laplace generate: the prompt")
    max_new_tokens: int = knob(48, _positive, doc="tokens generated (also the logged MLflow model's default)")
    temperature: float = knob(0.8, _non_negative, "0 = greedy")
    top_p: float = knob(
        0.95, _unit_interval, doc="nucleus sampling: the smallest set of tokens holding this much probability"
    )
    seed: int = knob(0, doc="sampling seed")


@dataclass(frozen=True)
class EngineSection:
    """`engine:` the decode engine: warmup, serve-check, numerics, probes and laplace serve build it from this.

    Its device and shapes. Every stage that builds an engine reads the whole section, as do
    `laplace serve` and the logged MLflow model (its model_config)."""

    device: Literal["auto", "cpu", "cuda", "neuron"] = knob("auto", doc="auto | cpu | cuda | neuron")
    compile_scope: Literal["block", "model"] = knob(
        "block",
        doc="what compiles just in time: block: one GLA block, reused by every layer | model: the whole step, one "
        "graph (CUDA graphs on CUDA); on CPU warmup ships every graph as an ahead-of-time package of the whole step",
    )
    max_slots: int = knob(8, _positive, "concurrent sequences; one more (dummy) slot takes the padding rows")
    widths: list[int] = knob([], doc="decode width ladder; [] = powers of two up to max_slots ([1, 2, 4, 8] for 8)")
    prefill_buckets: list[int] = knob([64, 256], doc="prompts are right-padded to one of these lengths")
    max_prompt_tokens: int = knob(256, _positive, "longer prompts are rejected")
    max_queue: int = knob(64, _positive, "requests that may wait for a slot; one more is rejected at once")
    prefix_cache_bytes: int = knob(
        64 << 20, _non_negative, "state prefix cache: bytes of cached prompt-prefix states (LRU; 0 = off)"
    )
    prefix_cache_min_tokens: int = knob(
        16, _positive, "state prefix cache: the shortest shared prefix worth splitting a prefill at and storing"
    )
    max_context: int = knob(
        2048,
        _positive,
        "models with attention layers: the tokens (prompt + generated) a sequence may reach; each slot's K/V "
        "cache holds this many (a longer request is refused; a GLA model has no such limit)",
    )


@dataclass(frozen=True)
class ServerSection:
    """`server:` laplace serve, the live server.

    serve-check's replays and live phase run as that server does, on an address and policy of
    their own: serve-check declares threads, max_new_tokens, shutdown_grace_s and the request limits
    (max_request_bytes, max_stop_chars), not the rest."""

    host: str = knob("127.0.0.1", doc="laplace serve listens here (loopback: only this machine can connect)")
    port: int = knob(8000, lambda v: None if 0 <= v < 65536 else "must be in [0, 65535]", "laplace serve's port")
    policy: Literal["padded", "exact", "eager"] = knob(
        "padded", doc="laplace serve: padded (warmed ladder, compiled) | exact | eager (no compiler)"
    )
    max_new_tokens: int = knob(1024, _positive, "the largest max_tokens one request may ask for")
    threads: int = knob(
        1,
        _non_negative,
        (
            "intra-op threads of serve-check's replays and laplace serve (0 = "
            "torch's: one per core); 1 leaves a core to the HTTP side and a client:"
            " on a busy 2-core machine a step whose OpenMP threads wait for a "
            "descheduled sibling stalls for 100s of ms"
        ),
    )
    shutdown_grace_s: float = knob(
        10.0, _non_negative, "on SIGTERM: no new requests; in-flight ones get this long to finish"
    )
    max_request_bytes: int = knob(2 * 2**20, _positive, "a larger request body is refused with 413")
    max_stop_chars: int = knob(1024, _positive, "the longest stop string a request may give")


@dataclass(frozen=True)
class ServeCheckSection:
    """`serve_check:` the workloads serve-check replays (and serves live), and its gates."""

    requests: int = knob(48, _positive, "requests per replayed workload")
    workloads: list[str] = knob(["batch", "poisson", "bursty"], doc="arrival processes replayed")
    exact_workloads: list[str] = knob(
        ["poisson"],
        lambda v: (
            None if v else "must name at least one workload (its exact vs padded replay is the headline comparison)"
        ),
        doc="also replayed with the exact (compile-on-first-sight) policy",
    )
    shared_prefix_tokens: int = knob(
        128, _positive, "the shared_prefix workload (padded, prefix cache off vs on): the system prompt's length"
    )
    rate: float = knob(25.0, _positive, "mean arrivals per second (poisson, bursty)")
    burst_cv: float = knob(3.0, _positive, "bursty: coefficient of variation of inter-arrival gaps (Gamma)")
    prompt_tokens: list[int] = knob([8, 256], doc="[min, max] prompt length, log-uniform")
    output_tokens: list[int] = knob([8, 64], doc="[min, max] new tokens per request, log-uniform")
    temperature: float = knob(0.0, _non_negative, "0 = greedy")
    top_p: float = knob(1.0, _unit_interval, doc="nucleus sampling of the replayed requests (1 = off)")
    slo_ttft_s: float = knob(1.0, _positive, "goodput: time to first token at most this")
    slo_tpot_s: float = knob(0.05, _positive, "goodput: time per output token at most this")
    decode_contexts: list[int] = knob([2048, 8192], doc="prompt lengths for the decode-cost-vs-context check")
    decode_timing_steps: int = knob(64, _positive, doc="decode steps timed at each decode context")
    max_decode_cost_ratio: float = knob(1.05, _positive, "gate: decode cost at the longest / shortest context")
    live: bool = knob(True, doc="serve-check also serves the headline workload live (laplace serve + load generator)")
    live_startup_s: float = knob(300.0, _positive, "serve-check's live phase: how long the server may take to warm up")
    seed: int = knob(0, doc="seeds the workloads (arrivals, lengths, prompt windows)")


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
    batch_size: int = knob(4, _positive, "held-out sequences per check")
    seq_len: int = knob(128, _positive, "prefill / training-step length")
    greedy_prompts: int = knob(4, _positive, doc="prompts decoded greedily, compiled vs eager")
    greedy_tokens: int = knob(32, _positive, doc="tokens decoded greedily after each")
    prompt_tokens: int = knob(32, _positive, doc="prompt length of the decode-step comparison")
    decode_tokens: int = knob(8, _positive, "tokens decoded after each prompt in the decode-step comparison")
    margin: float = knob(
        0.5, _non_negative, "top-1 agreement also reported on positions with fp64 top1-top2 gap >= margin"
    )
    fp32_rel_rms_max: float = knob(1e-5, _positive, "gate: fp32 compiled vs fp64 relative RMS of logits")
    fp32_top1_min: float = knob(1.0, _unit_interval, "gate: fp32 compiled vs eager top-1 agreement")
    bf16_error_ratio_max: float = knob(1.5, _positive, "gate: bf16 compiled error vs fp64 <= this x eager's")
    bf16_top1_min: float = knob(0.99, _unit_interval, "gate: bf16 top-1 agreement with fp64 on clear-margin positions")
    grad_rel_rms_fp32_max: float = knob(1e-4, _positive, "gate: fp32 compiled training-step gradients vs fp64")
    seed: int = knob(0, doc="seeds the held-out windows")


@dataclass(frozen=True)
class ProbesSection:
    """`probes:` retrieval probes and memory accounting (probes)."""

    mqar_contexts: list[int] = knob([64, 256, 1024], doc="MQAR sequence lengths")
    mqar_pairs: list[int] = knob([4, 8, 16], doc="key-value pairs per sequence")
    mqar_samples: int = knob(32, _positive, "sequences per (context, pairs) cell")
    paths_agree_min: float = knob(
        0.99, _unit_interval, "gate: MQAR argmax agreement of the serving path and the eager forward"
    )
    passkey_contexts: list[int] = knob([256, 1024, 4096], doc="passkey prompt lengths")
    passkey_depths: list[float] = knob([0.1, 0.5, 0.9], doc="where the passkey sits, as a fraction of the context")
    passkey_samples: int = knob(2, _positive, doc="prompts per (context, depth) cell")
    recall_contexts: list[int] = knob(
        [256, 1024, 4096],
        doc="NIAH (single key, multi-key, multi-value) prompt lengths; train.seq_len and 4 x train.seq_len "
        "(the length the model was trained at, and beyond it) are added where not below the shortest of these",
    )
    recall_samples: int = knob(4, _positive, doc="NIAH prompts per (task, length); they decode together")
    memory_contexts: list[int] = knob([1024, 4096, 16384, 32768], doc="decode memory measured after these")
    kv_contexts: list[int] = knob(
        [2048, 8192, 32768], doc="contexts at which a transformer's KV-cache bytes are reported beside the GLA state"
    )
    train_mqar: bool = knob(True, doc="train a small GLA on MQAR so the probe is seen to measure something")
    mqar_train_steps: int = knob(600, _positive, doc="learning is a sudden jump after ~150-250 steps")
    mqar_train_d_model: int = knob(128, _positive, doc="hidden size of the MQAR model")
    mqar_train_layers: int = knob(2, _positive, doc="its layers")
    mqar_train_heads: int = knob(2, _positive, doc="its heads")
    mqar_train_gate_bias: float = knob(4.0, doc="forget gates start near 1 (long memory)")
    mqar_train_vocab: int = knob(
        64,
        _positive,
        (
            "MQAR training vocabulary: 24 key ids, 32 value ids, so chance is 1/32 "
            "(a larger one stays on the plateau longer)"
        ),
    )
    mqar_train_seq_len: int = knob(64, _positive, doc="its sequence length")
    mqar_train_pairs: int = knob(8, _positive, "the hardest pair count sampled during MQAR training")
    mqar_train_batch_size: int = knob(16, _positive, "small batches reach the jump in accuracy soonest on a CPU")
    mqar_train_lr: float = knob(5e-3, _positive, "AdamW learning rate of the MQAR model")
    mqar_train_muon_lr: float = knob(0.02, _positive, doc="Muon learning rate of the MQAR model")
    mqar_train_warmup_steps: int = knob(20, _non_negative, doc="its learning-rate warmup")
    seed: int = knob(0, doc="seeds the probe samples and the MQAR model")


@dataclass(frozen=True)
class TrackingSection:
    """`tracking:` MLflow: where the run is logged and how the model is registered (track)."""

    experiment: str = knob(
        "laplace", doc="MLflow experiment (store: sqlite mlflow.db in the project, or MLFLOW_TRACKING_URI)"
    )
    model_name: str = knob(
        "laplace-gla", doc="registered model: alias candidate; champion when the gates pass and it is no worse"
    )
    champion_tolerance: float = knob(
        0.0,
        _non_negative,
        (
            "a new version takes the champion alias only if its val_loss is at most"
            " the current champion's plus this (nats/token), on the same validation"
            " windows and tokenizer"
        ),
    )
    champion_recall_tolerance: float = knob(
        0.05,
        _unit_interval,
        "nor if its recall (probes' recall suite) at any length both measured falls below the champion's by more "
        "(and by more than two binomial standard errors of the difference, from each side's recall_samples)",
    )
    register: bool = knob(True, doc="register the exported model (alias candidate; champion when it earns it)")
    retry_seconds: float = knob(
        60.0,
        _non_negative,
        (
            "track waits this long, with backoff, for an unreachable tracking "
            "server (0 = one try), then fails with one line; nothing is lost: rerun"
            " `laplace track` / `dvc repro` to log the run"
        ),
    )


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
    decode_timing_steps: int = knob(24, _positive, "decode steps timed at each of decode_contexts")
    table_contexts: list[int] = knob(
        [2048, 8192], doc="the table's decode ms per token columns (each one of decode_contexts)"
    )
    lm_eval_tasks: list[str] = knob(
        ["niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_cwe", "ruler_fwe"],
        doc="lm-evaluation-harness RULER tasks run on every arm (one that cannot run offline is reported, not run)",
    )
    lm_eval_limit: int = knob(4, _positive, "samples per RULER task and length")
    lm_eval_lengths: list[int] = knob([1024], doc="RULER's max_seq_lengths")
    lm_eval_timeout_s: float = knob(
        600.0, _positive, "a RULER task still running after this long is killed and reported as not run"
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
        ["gla", "hybrid-1in4", "hybrid-1in2", "softmax"],
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
        _positive,
        "layers of every MQAR model (2: a hybrid is one GLA and one attention layer, both hybrids alike; 4 keeps "
        "a 1-in-4 and a 1-in-2 pattern apart at about 2.2x the time per step)",
    )
    heads: int = knob(2, _positive, doc="GLA and attention heads of every MQAR model")
    gate_bias: float = knob(4.0, doc="GLA forget gates start near 1 (long memory)")
    vocab: int = knob(128, _positive, doc="MQAR vocabulary: 48 key ids, 64 value ids (chance 1/64)")
    seq_len: int = knob(64, _positive, doc="training sequence length (and the gate's reference context)")
    train_pairs: int = knob(16, _positive, doc="each training batch mixes 1..this many key-value pairs")
    steps: int = knob(
        650,
        _positive,
        "training steps of every cell (at 500 a width-64 GLA was mid-jump in one seed of 3 and the gate could not "
        "tell widths 32 and 64 apart; one cell is 10-30 s on 2 cores)",
    )
    batch_size: int = knob(16, _positive, doc="sequences per training step")
    warmup_steps: int = knob(20, _non_negative, doc="linear learning-rate warmup, then cosine to zero")
    adamw_lr_ratio: float = knob(1.0, _positive, doc="AdamW's learning rate (embeddings, gates, norms) over Muon's")
    contexts: list[int] = knob([64], doc="test sequence lengths")
    pairs: list[int] = knob([4, 8, 16], doc="test key-value pair counts (a cell per length and count that fits)")
    test_queries: int = knob(
        1000,
        lambda v: None if v >= 1000 else f"must be >= 1000, got {v}: fewer cannot resolve a few points of accuracy",
        doc="at least this many test queries per (length, pairs) cell and seed (1,000 or more)",
    )
    test_seed: int = knob(1_000_003, doc="seeds the test sequences (the same for every model: paired comparisons)")
    reference_pairs: int = knob(
        16, _positive, doc="the gate's reference cell: this many pairs at seq_len, which all-attention must solve"
    )
    attention_min: float = knob(0.99, _unit_interval, doc="gate: all-attention's accuracy on the reference cell")
    significance_se: float = knob(
        2.0,
        _positive,
        "a difference counts when it exceeds this many standard errors (seed spread included): the gate, the "
        "pick and the headline",
    )


@dataclass(frozen=True)
class PipelineSection:
    """`pipeline:` Prefect task settings (flows/pipeline.py)."""

    retries: int = knob(1, _non_negative, "retries after a transient failure; bad params are never retried")
    retry_delay_s: float = knob(10.0, _non_negative, doc="seconds between Prefect retries")
    stage_timeout_s: float = knob(7200.0, _positive, "Prefect timeout of one stage")


@dataclass(frozen=True)
class Config:
    seed: int = knob(1234, doc="seeds the tokenizer sample, the validation split, the model init and the data order")
    data: DataSection = field(default_factory=DataSection)
    tokenizer: TokenizerSection = field(default_factory=TokenizerSection)
    model: ModelSection = field(default_factory=ModelSection)
    train: TrainSection = field(default_factory=TrainSection)
    adamw: AdamWSection = field(default_factory=AdamWSection)
    muon: MuonSection = field(default_factory=MuonSection)
    generate: GenerateSection = field(default_factory=GenerateSection)
    engine: EngineSection = field(default_factory=EngineSection)
    server: ServerSection = field(default_factory=ServerSection)
    serve_check: ServeCheckSection = field(default_factory=ServeCheckSection)
    numerics: NumericsSection = field(default_factory=NumericsSection)
    probes: ProbesSection = field(default_factory=ProbesSection)
    tracking: TrackingSection = field(default_factory=TrackingSection)
    pipeline: PipelineSection = field(default_factory=PipelineSection)
    compare: CompareSection = field(default_factory=CompareSection)
    mqar: MqarSection = field(default_factory=MqarSection)

    def model_config(self, vocab_size: int | None = None) -> ModelConfig:
        """The resolved architecture: preset, then params overrides, then the tokenizer's vocab size."""
        overrides = {f.name: getattr(self.model, f.name) for f in dataclasses.fields(ModelSection)}
        preset = overrides.pop("preset")
        if overrides.pop("init"):
            return init_model_config(self.model)
        if overrides["vocab_size"] is None and not PRESETS.get(preset, {}).get("vocab_size"):
            overrides["vocab_size"] = vocab_size or self.tokenizer.vocab_size
        return preset_model_config(preset, **overrides)

    def to_dict(self) -> dict:
        """The config as params.yaml lays it out (keys as written there: `tokenizer.from`)."""

        def plain(obj):
            if dataclasses.is_dataclass(obj):
                return {yaml_key(f): plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
            return [plain(v) for v in obj] if isinstance(obj, list) else obj

        return plain(self)

    def flat(self) -> dict[str, Any]:
        """Every effective knob as `section.key: value` (for tracking)."""
        out: dict[str, Any] = {}

        def walk(prefix, value):
            if isinstance(value, dict):
                for k, v in value.items():
                    walk(f"{prefix}.{k}" if prefix else k, v)
            else:
                out[prefix] = value

        walk("", self.to_dict())
        return out

    def digest(self) -> str:
        """A stable hash of every effective knob."""
        blob = json.dumps(self.to_dict(), sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


# --------------------------------------------------------------------------- building


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def _coerce(value, tp, key: str):
    """Check `value` against the annotation `tp`; ints are accepted for floats."""
    if tp is Any:  # a structured knob (model.attn) that its own validator checks
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                continue
        names = " or ".join(_type_name(a) for a in args if a is not type(None))
        raise ConfigError(f"{key}: expected {names}, got {type(value).__name__} {value!r}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key}: must be one of {', '.join(map(str, choices))}, got {value!r}")
        return value
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {type(value).__name__} {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{key}: must be finite, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {type(value).__name__} {value!r}")
        return value
    raise TypeError(f"unsupported annotation {tp!r} for {key}")


def _build(cls, raw: Any, prefix: str):
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix or 'params'}: expected a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {yaml_key(f): f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            where = f"{prefix}.{key}" if prefix else str(key)
            if where in RENAMED:
                raise ConfigError(f"'{where}' is now '{RENAMED[where]}': rename the key (same value)")
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"unknown key '{where}'{hint}")
    values = {}
    for name, f in fields.items():
        key = f"{prefix}.{name}" if prefix else name
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            values[f.name] = _build(tp, raw.get(name), key)
            continue
        if name not in raw:
            continue
        value = _coerce(raw[name], tp, key)
        check = f.metadata.get("check")
        if check is not None and value is not None:
            why = check(value)
            if why:
                raise ConfigError(f"{key}: {why}, got {value!r}")
        values[f.name] = value
    return cls(**values)


def config_from_dict(raw: dict) -> Config:
    cfg = _build(Config, raw, "")
    cfg.model_config()  # validates preset and architecture overrides now, not at first use
    t = cfg.train
    if t.nnodes > 1 and not t.rdzv_endpoint:
        raise ConfigError("train.rdzv_endpoint: required (host:port) when train.nnodes > 1")
    if t.node_rank >= t.nnodes:
        raise ConfigError(f"train.node_rank: must be < train.nnodes={t.nnodes}, got {t.node_rank}")
    if t.batch_size % (t.nproc_per_node * t.nnodes):
        raise ConfigError(
            f"train.batch_size: {t.batch_size} is not divisible by the "
            f"{t.nproc_per_node * t.nnodes} ranks (nproc_per_node x nnodes)"
        )
    width_ladder(cfg.engine.max_slots, cfg.engine.widths)  # refused now, not when an engine is built
    check_project_paths(cfg)
    check_attention_windows(cfg.model_config(), cfg.engine.max_context)
    return cfg


def check_attention_windows(model: ModelConfig, max_context: int) -> None:
    """A sliding window wider than the longest context a slot holds never slides: refused by name."""
    for spec in model.attn_specs:
        window = spec["window_size"]
        if window is not None and window > max_context:
            raise ConfigError(
                f"model.attn: window_size={window} of layers {spec['layers']} is larger than the context, "
                f"engine.max_context={max_context}"
            )


def width_ladder(max_slots: int, widths: list[int] | None = None) -> list[int]:
    """The decode widths (engine.widths), the one rule for them: as written, strictly increasing
    from >= 1 up to exactly max_slots (a wider graph would only pad rows no slot can fill), else a
    ConfigError; empty: powers of two up to max_slots, max_slots included. The config checks it
    when it is read and every engine builds its ladder with it."""
    ladder = [1 << i for i in range(max_slots.bit_length()) if (1 << i) < max_slots] + [max_slots]
    if not widths:
        return ladder
    ordered = all(a < b for a, b in zip(widths, widths[1:]))
    if not ordered or widths[0] < 1 or widths[-1] != max_slots:
        raise ConfigError(
            f"engine.widths: must increase strictly from >= 1 to max_slots={max_slots} (e.g. {ladder}), got {widths}"
        )
    return list(widths)


def project_path_knobs(cfg: Config) -> list[tuple[str, str]]:
    """(key, value) of every knob naming a file or directory to read. data.hub_path is a hub
    id or a local directory; hub ids never contain a '..' component, so the check is safe for both."""
    return [("data.path", cfg.data.path)] + [
        ("tokenizer.from", cfg.tokenizer.from_),
        ("model.init", cfg.model.init),
        ("data.hub_path", cfg.data.hub_path),
    ]


def init_model_config(model: ModelSection) -> ModelConfig:
    """The architecture of model.init's export (the weights decide it); a model.* override that
    disagrees with it is a ConfigError naming the key (model.kernel is the process's choice)."""
    # config.json read here, not through laplace.model.export: every stage reads this module
    path = Path(model.init) / "config.json"
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
        assert isinstance(found, dict) and isinstance(found.get("model"), dict)
    except (OSError, ValueError, AssertionError):
        raise ConfigError(
            f"model.init: {path} is missing or not an export's config (run `laplace import` first)"
        ) from None
    arch = dict(found["model"])
    for name, value in dataclasses.asdict(model).items():
        if name in ("preset", "init", "kernel") or value is None:
            continue
        if arch.get(name) != value:
            raise ConfigError(
                f"model.{name}: {value!r} disagrees with model.init {model.init} ({arch.get(name)!r}); "
                "leave it empty to take the init's"
            )
    return validate_model_config(ModelConfig(**{**arch, "kernel": model.kernel}), "model.init")


def check_project_paths(cfg: Config) -> None:
    """Relative paths (and globs) are read from the project directory and must stay inside it:
    one that climbs out with '..' is a ConfigError naming the key. Absolute paths are the
    explicit way to read elsewhere. The check is lexical (symlinks inside the project are
    the project owner's), so it gives the same answer whatever the current directory."""
    for key, value in project_path_knobs(cfg):
        if not value or os.path.isabs(value):
            continue
        parts = os.path.normpath(value).split(os.sep)
        if parts[0] == os.pardir:
            levels = next((i for i, part in enumerate(parts) if part != os.pardir), len(parts))
            raise ConfigError(
                f"{key}: {value!r} resolves outside the project ({levels} level(s) above the project "
                "directory, where relative paths are read); give an absolute path to read outside it"
            )


def knob_docs(cls: type = None, prefix: str = "") -> dict[str, str]:
    """`section.key: doc` of every knob, and `section: doc` of every section (its docstring's first
    paragraph, less the leading `name:`): the one place a knob is documented (params.yaml's
    comments are written from it)."""
    cls = cls or Config
    out: dict[str, str] = {}
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{yaml_key(f)}" if prefix else yaml_key(f)
        tp = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            first = (tp.__doc__ or "").strip().split("\n\n")[0]
            out[key] = " ".join(first.removeprefix(f"`{f.name}:`").split()).rstrip(".")
            out.update(knob_docs(tp, key))
        else:
            out[key] = f.metadata.get("doc", "")
    return out


def default_params() -> dict:
    """The defaults in code, as a params.yaml mapping (tests compare it with the file)."""
    return Config().to_dict()
