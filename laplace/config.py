"""Typed, validated configuration sections: every knob, with its default, check and doc.

`config_from_dict()` builds frozen dataclasses from a params mapping; any unknown key,
wrong type or impossible value raises `ConfigError` with a one-line message naming the
key. This module knows nothing of files, stages or tracking, so the library may import
it; reading params.yaml and applying `--set` overrides live in `laplace.pipeline.params`.
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
from typing import Any, Literal

from laplace.errors import ConfigError
from laplace.model.config import PRESETS, ModelConfig, preset_model_config

__all__ = ["Config", "ConfigError", "ModelConfig", "config_from_dict", "default_params", "knob"]


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


def knob(default, check=None, doc: str = ""):
    """A config field with a default, an optional value check and a docstring."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"check": check, "doc": doc})
    return field(default=default, metadata={"check": check, "doc": doc})


# --------------------------------------------------------------------------- sections


@dataclass(frozen=True)
class ModelSection:
    """`model:` in params.yaml: a preset plus optional per-field overrides (null = the preset's value)."""

    preset: str = knob("tiny", doc="tiny | small | laplace-3b")
    vocab_size: int | None = knob(None, doc="null: the preset's, or the tokenizer's vocab size")
    d_model: int | None = knob(None)
    n_layers: int | None = knob(None)
    n_heads: int | None = knob(None)
    expand_k: float | None = knob(None)
    expand_v: float | None = knob(None)
    mlp_hidden: int | None = knob(None)
    gate_low_rank_dim: int | None = knob(None)
    gate_logit_normalizer: float | None = knob(None)
    gate_bias_init: float | None = knob(None)
    use_short_conv: bool | None = knob(None)
    conv_size: int | None = knob(None)
    chunk_size: int | None = knob(None)
    sub_chunk_size: int | None = knob(None)
    segment_len: int | None = knob(None)
    tie_embeddings: bool | None = knob(None)
    init_std: float | None = knob(None)
    dtype: str | None = knob(None)
    kernel: Literal["auto", "torch", "fla"] = knob(
        "auto",
        doc="the GLA core: torch (plain PyTorch, anywhere), fla (flash-linear-attention's Triton kernels, CUDA, "
        "pip install 'laplace[cuda]'), auto (fla on CUDA when installed, else torch)",
    )


@dataclass(frozen=True)
class DataSection:
    source: Literal["python-docs", "files", "hub"] = knob(
        "python-docs",
        doc="python-docs: offline default (data.path, else the Python install); files: data.path; hub: a dataset",
    )
    path: str = knob(
        "data/python-docs",
        lambda v: None if v.strip() else "must name a file or directory",
        "the corpus: a directory (walked) or one file; the tokenize stage's DVC dependency",
    )
    hub_path: str = knob("HuggingFaceFW/fineweb-edu", doc="a hub dataset name, or a local dataset directory")
    hub_name: str = knob("sample-10BT")
    hub_split: str = knob("train")
    text_field: str = knob("text")
    max_documents: int = knob(0, _non_negative, "0 = no cap; else shared evenly among the slices")
    max_tokens: int = knob(0, _non_negative, "train tokens, 0 = no cap; else shared evenly among the slices")
    min_chars: int = knob(64, _positive, "shorter documents are skipped (and counted)")
    max_document_chars: int = knob(1_000_000, _positive, "longer text files are cut at blank lines into documents")
    val_fraction: float = knob(0.05, _fraction)
    on_bad_file: Literal["skip", "error"] = knob("skip", doc="undecodable or binary input: skip it (logged) or stop")
    slices: int = knob(16, _positive, "input slices (files hashed by path, hub shards): the unit of work and reuse")
    shard_tokens: int = knob(100_000_000, _positive, "tokens per shard file (the last of each slice is shorter)")
    num_proc: int = knob(2, _positive, "tokenizer worker processes")


@dataclass(frozen=True)
class TokenizerSection:
    vocab_size: int = knob(4096, lambda v: None if v >= 260 else "must be >= 260 (256 bytes + specials)")
    min_frequency: int = knob(2, _positive)
    sample_bytes: int = knob(100_000_000, _positive, "the BPE trains on a seeded sample of at most this much text")
    path: str = knob("", doc="an existing tokenizer.json to use instead of training one")


@dataclass(frozen=True)
class TrainSection:
    steps: int = knob(300, _positive)
    batch_size: int = knob(8, _positive, "sequences per step (global, across ranks)")
    seq_len: int = knob(256, _positive)
    lr: float = knob(3e-3, _positive, "AdamW learning rate (embeddings, head, norms, biases)")
    schedule: Literal["cosine", "wsd", "constant"] = knob("cosine")
    warmup_steps: int = knob(20, _non_negative)
    min_lr_ratio: float = knob(0.1, lambda v: None if 0 <= v <= 1 else "must be in [0, 1]")
    decay_fraction: float = knob(0.2, _unit_interval, "wsd: share of steps spent decaying")
    grad_clip: float = knob(1.0, _non_negative, "0 disables clipping")
    precision: Literal["fp32", "bf16"] = knob(
        "fp32",
        doc="bf16: FSDP2 mixed precision, bf16 parameters and compute, fp32 gradient reduction and master weights",
    )
    compile: bool = knob(False)
    device: Literal["auto", "cpu", "cuda", "neuron"] = knob("auto")
    eval_every: int = knob(50, _positive)
    eval_batches: int = knob(8, _positive)
    checkpoint_every: int = knob(100, _positive)
    keep_checkpoints: int = knob(2, _positive)
    log_every: int = knob(10, _positive)
    nproc_per_node: int = knob(1, _positive, "ranks per node; > 1 launches torchrun")
    nnodes: int = knob(1, _positive)
    node_rank: int = knob(0, _non_negative)
    rdzv_endpoint: str = knob("", doc="host:port of the c10d rendezvous; empty = one node, --standalone")
    rdzv_id: str = knob("laplace", doc="rendezvous id shared by the nodes of one job")
    max_restarts: int = knob(0, _non_negative, "torchrun restarts the whole job this often after a failure")


@dataclass(frozen=True)
class AdamWSection:
    betas: list[float] = knob([0.9, 0.95])
    eps: float = knob(1e-8, _positive)
    weight_decay: float = knob(0.1, _non_negative, "applied to embeddings and head; never to norms/biases")


@dataclass(frozen=True)
class MuonSection:
    lr: float = knob(0.02, _positive)
    momentum: float = knob(0.95, _fraction)
    nesterov: bool = knob(True)
    ns_steps: int = knob(5, lambda v: None if 0 < v < 100 else "must be in [1, 99]")
    ns_coefficients: list[float] = knob([3.4445, -4.775, 2.0315])
    eps: float = knob(1e-7, _positive)
    weight_decay: float = knob(0.0, _non_negative)
    adjust_lr_fn: Literal["original", "match_rms_adamw"] = knob("original")
    comm: Literal["alltoall", "allgather"] = knob(
        "alltoall", doc="sharded Newton-Schulz: whole matrices on owner ranks (two all-to-alls) or everywhere"
    )


@dataclass(frozen=True)
class GenerateSection:
    prompt: str = knob("The function")
    max_new_tokens: int = knob(48, _positive)
    temperature: float = knob(0.8, _non_negative, "0 = greedy")
    top_p: float = knob(0.95, _unit_interval)
    seed: int = knob(0)


@dataclass(frozen=True)
class ServeSection:
    """Serving: the decode engine, the compile warmup, `laplace serve` and the workloads of serve-check."""

    device: Literal["auto", "cpu", "cuda", "neuron"] = knob("auto")
    host: str = knob("127.0.0.1", doc="laplace serve listens here (loopback: only this machine)")
    port: int = knob(8000, lambda v: None if 0 <= v < 65536 else "must be in [0, 65535]", "laplace serve's port")
    policy: Literal["padded", "exact", "eager"] = knob(
        "padded", doc="laplace serve: padded (warmed ladder, compiled), exact, or eager (no compiler)"
    )
    max_new_tokens: int = knob(1024, _positive, "the largest max_tokens one request may ask for")
    threads: int = knob(
        1,
        _non_negative,
        "intra-op threads of serve-check's replays and laplace serve (0 = torch's default, one per core)",
    )
    shutdown_grace_s: float = knob(10.0, _non_negative, "on SIGTERM, in-flight requests get this long to finish")
    max_request_bytes: int = knob(2 * 2**20, _positive, "laplace serve: a larger request body is refused (413)")
    max_stop_chars: int = knob(1024, _positive, "laplace serve: the longest stop string a request may give")
    compile_scope: Literal["block", "model"] = knob(
        "block", doc="block: compile one GLA block, reused by every layer; model: the whole step as one graph"
    )
    max_slots: int = knob(8, _positive, "concurrent sequences (state slots); one more dummy slot pads")
    widths: list[int] = knob([], doc="decode width ladder; empty = powers of two up to max_slots")
    prefill_buckets: list[int] = knob([64, 256], doc="prompt lengths are padded up to one of these")
    max_prompt_tokens: int = knob(256, _positive, "longer prompts are rejected")
    max_queue: int = knob(64, _positive, "requests that may wait for a slot; one more is rejected at once")
    requests: int = knob(48, _positive, "requests per replayed workload")
    workloads: list[str] = knob(["batch", "poisson", "bursty"], doc="arrival processes replayed")
    exact_workloads: list[str] = knob(["poisson"], doc="workloads also replayed with the exact policy")
    rate: float = knob(25.0, _positive, "mean arrivals per second (poisson, bursty)")
    burst_cv: float = knob(3.0, _positive, "bursty: coefficient of variation of the gaps (Gamma)")
    prompt_tokens: list[int] = knob([8, 256], doc="[min, max] prompt length, log-uniform")
    output_tokens: list[int] = knob([8, 64], doc="[min, max] new tokens per request, log-uniform")
    temperature: float = knob(0.0, _non_negative, "0 = greedy")
    top_p: float = knob(1.0, _unit_interval)
    slo_ttft_s: float = knob(1.0, _positive, "goodput: time to first token at most this")
    slo_tpot_s: float = knob(0.05, _positive, "goodput: time per output token at most this")
    decode_contexts: list[int] = knob([2048, 8192], doc="prompt lengths for the decode-cost-vs-context check")
    decode_timing_steps: int = knob(64, _positive)
    max_decode_cost_ratio: float = knob(1.05, _positive, "gate: decode cost at the longest / shortest context")
    live: bool = knob(True, doc="serve-check also serves the headline workload live: laplace serve + load generator")
    live_startup_s: float = knob(300.0, _positive, "serve-check's live phase: how long the server may take to warm up")
    seed: int = knob(0)


@dataclass(frozen=True)
class NumericsSection:
    """Eager vs compiled vs fp64 checks on the exported model (the numerics stage)."""

    mode: Literal["compare", "eager"] = knob(
        "compare", doc="compare: compiled vs eager vs fp64 gates; eager: also prove bitwise eager reproducibility"
    )
    batch_size: int = knob(4, _positive, "held-out sequences per check")
    seq_len: int = knob(128, _positive, "prefill / training-step length")
    greedy_prompts: int = knob(4, _positive)
    greedy_tokens: int = knob(32, _positive)
    prompt_tokens: int = knob(32, _positive)
    decode_tokens: int = knob(8, _positive, "tokens decoded after each prompt in the decode-step comparison")
    margin: float = knob(
        0.5, _non_negative, "top-1 agreement also counted on positions whose fp64 top-1/top-2 gap >= this"
    )
    fp32_rel_rms_max: float = knob(1e-5, _positive, "gate: fp32 compiled vs fp64 relative RMS of logits")
    fp32_top1_min: float = knob(1.0, _unit_interval, "gate: fp32 compiled vs eager top-1 agreement")
    bf16_error_ratio_max: float = knob(1.5, _positive, "gate: bf16 compiled error vs fp64 <= this x eager's")
    bf16_top1_min: float = knob(0.99, _unit_interval, "gate: bf16 top-1 agreement with fp64 on clear-margin positions")
    grad_rel_rms_fp32_max: float = knob(1e-4, _positive, "gate: fp32 compiled training-step gradients vs fp64")
    seed: int = knob(0)


@dataclass(frozen=True)
class ProbesSection:
    """Retrieval probes and memory accounting (the probes stage)."""

    mqar_contexts: list[int] = knob([64, 256, 1024], doc="MQAR sequence lengths")
    mqar_pairs: list[int] = knob([4, 8, 16], doc="key-value pairs per sequence")
    mqar_samples: int = knob(32, _positive, "sequences per (context, pairs) cell")
    paths_agree_min: float = knob(0.99, _unit_interval, "gate: MQAR argmax agreement of the serving and eager paths")
    passkey_contexts: list[int] = knob([256, 1024, 4096])
    passkey_depths: list[float] = knob([0.1, 0.5, 0.9], doc="where the passkey sits, as a fraction of the context")
    passkey_samples: int = knob(2, _positive)
    memory_contexts: list[int] = knob([1024, 4096, 16384, 32768], doc="decode memory measured after these")
    kv_contexts: list[int] = knob([2048, 8192, 32768])
    train_mqar: bool = knob(True, doc="train a small GLA on MQAR so the probe is seen to measure something")
    mqar_train_steps: int = knob(600, _positive)
    mqar_train_d_model: int = knob(128, _positive)
    mqar_train_layers: int = knob(2, _positive)
    mqar_train_heads: int = knob(2, _positive)
    mqar_train_gate_bias: float = knob(4.0, doc="forget-gate bias init: > 0 starts with long memory")
    mqar_train_vocab: int = knob(64, _positive, "MQAR training vocabulary (a larger one stays on the plateau longer)")
    mqar_train_seq_len: int = knob(64, _positive)
    mqar_train_pairs: int = knob(8, _positive, "the hardest pair count sampled during MQAR training")
    mqar_train_batch_size: int = knob(16, _positive, "small batches reach the jump in accuracy soonest on a CPU")
    mqar_train_lr: float = knob(5e-3, _positive, "AdamW learning rate of the MQAR model")
    mqar_train_muon_lr: float = knob(0.02, _positive)
    mqar_train_warmup_steps: int = knob(20, _non_negative)
    seed: int = knob(0)


@dataclass(frozen=True)
class TrackingSection:
    experiment: str = knob("laplace", doc="MLflow experiment")
    model_name: str = knob("laplace-gla", doc="MLflow registered model name")
    champion_tolerance: float = knob(
        0.0,
        _non_negative,
        "a new version takes the champion alias only if its val_loss is at most the current "
        "champion's plus this (nats/token), on the same validation windows and tokenizer",
    )
    register: bool = knob(True, doc="register the exported model (alias candidate; champion when it earns it)")
    retry_seconds: float = knob(
        60.0,
        _non_negative,
        "how long track waits, with backoff, for an unreachable "
        "tracking server before failing (0 = one try); nothing is lost either way",
    )


@dataclass(frozen=True)
class PipelineSection:
    retries: int = knob(1, _non_negative, "Prefect retries of a stage after a transient failure")
    retry_delay_s: float = knob(10.0, _non_negative)
    stage_timeout_s: float = knob(7200.0, _positive, "Prefect timeout of one stage")


@dataclass(frozen=True)
class Config:
    seed: int = knob(1234)
    data: DataSection = field(default_factory=DataSection)
    tokenizer: TokenizerSection = field(default_factory=TokenizerSection)
    model: ModelSection = field(default_factory=ModelSection)
    train: TrainSection = field(default_factory=TrainSection)
    adamw: AdamWSection = field(default_factory=AdamWSection)
    muon: MuonSection = field(default_factory=MuonSection)
    generate: GenerateSection = field(default_factory=GenerateSection)
    serve: ServeSection = field(default_factory=ServeSection)
    numerics: NumericsSection = field(default_factory=NumericsSection)
    probes: ProbesSection = field(default_factory=ProbesSection)
    tracking: TrackingSection = field(default_factory=TrackingSection)
    pipeline: PipelineSection = field(default_factory=PipelineSection)

    def model_config(self, vocab_size: int | None = None) -> ModelConfig:
        """The resolved architecture: preset, then params overrides, then the tokenizer's vocab size."""
        overrides = {f.name: getattr(self.model, f.name) for f in dataclasses.fields(ModelSection)}
        preset = overrides.pop("preset")
        if overrides["vocab_size"] is None and not PRESETS.get(preset, {}).get("vocab_size"):
            overrides["vocab_size"] = vocab_size or self.tokenizer.vocab_size
        return preset_model_config(preset, **overrides)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

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
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            where = f"{prefix}.{key}" if prefix else str(key)
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"unknown key '{where}'{hint}")
    values = {}
    for name, f in fields.items():
        key = f"{prefix}.{name}" if prefix else name
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            values[name] = _build(tp, raw.get(name), key)
            continue
        if name not in raw:
            continue
        value = _coerce(raw[name], tp, key)
        check = f.metadata.get("check")
        if check is not None and value is not None:
            why = check(value)
            if why:
                raise ConfigError(f"{key}: {why}, got {value!r}")
        values[name] = value
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
    check_project_paths(cfg)
    return cfg


def project_path_knobs(cfg: Config) -> list[tuple[str, str]]:
    """(key, value) of every knob naming a file or directory to read. data.hub_path is a hub
    id or a local directory; hub ids never contain a '..' component, so the check is safe for both."""
    return [("data.path", cfg.data.path)] + [
        ("tokenizer.path", cfg.tokenizer.path),
        ("data.hub_path", cfg.data.hub_path),
    ]


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


def default_params() -> dict:
    """The defaults in code, as a params.yaml mapping (tests compare it with the file)."""
    return Config().to_dict()
