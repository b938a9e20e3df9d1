"""`generate:`, `engine:`, `server:` and `serve_check:`, the sections of the decode engine and what serves
through it (laplace/serving), with the one rule of the engine's decode widths."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from laplace.config.knobs import knob, non_negative, positive, unit_interval
from laplace.errors import ConfigError


@dataclass(frozen=True)
class GenerateSection:
    """`generate:` laplace generate, and the logged MLflow model's defaults (track)."""

    prompt: str = knob("The function", doc="laplace generate: the prompt")
    max_new_tokens: int = knob(48, positive, doc="tokens generated (also the logged MLflow model's default)")
    temperature: float = knob(0.8, non_negative, "0 = greedy")
    top_p: float = knob(
        0.95, unit_interval, doc="nucleus sampling: the smallest set of tokens holding this much probability"
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
    max_slots: int = knob(8, positive, "concurrent sequences; one more (dummy) slot takes the padding rows")
    widths: list[int] = knob([], doc="decode width ladder; [] = powers of two up to max_slots ([1, 2, 4, 8] for 8)")
    prefill_buckets: list[int] = knob([64, 256], doc="prompts are right-padded to one of these lengths")
    max_prompt_tokens: int = knob(
        32768,
        positive,
        "longer prompts are rejected (400 naming this knob); one longer than the largest bucket is prefilled a "
        "bucket per engine step, between the decode steps of the others (attention layers: max_context bounds it too)",
    )
    max_queue: int = knob(64, positive, "requests that may wait for a slot; one more is rejected at once")
    prefix_cache_bytes: int = knob(
        64 << 20, non_negative, "state prefix cache: bytes of cached prompt-prefix states (LRU; 0 = off)"
    )
    prefix_cache_min_tokens: int = knob(
        16, positive, "state prefix cache: the shortest shared prefix worth splitting a prefill at and storing"
    )
    max_context: int = knob(
        2048,
        positive,
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
    max_new_tokens: int = knob(1024, positive, "the largest max_tokens one request may ask for")
    threads: int = knob(
        1,
        non_negative,
        (
            "intra-op threads of serve-check's replays and laplace serve (0 = "
            "torch's: one per core); 1 leaves a core to the HTTP side and a client:"
            " on a busy 2-core machine a step whose OpenMP threads wait for a "
            "descheduled sibling stalls for 100s of ms"
        ),
    )
    shutdown_grace_s: float = knob(
        10.0, non_negative, "on SIGTERM: no new requests; in-flight ones get this long to finish"
    )
    max_request_bytes: int = knob(2 * 2**20, positive, "a larger request body is refused with 413")
    max_stop_chars: int = knob(1024, positive, "the longest stop string a request may give")


@dataclass(frozen=True)
class ServeCheckSection:
    """`serve_check:` the workloads serve-check replays (and serves live), and its gates."""

    requests: int = knob(48, positive, "requests per replayed workload")
    workloads: list[str] = knob(["batch", "poisson", "bursty"], doc="arrival processes replayed")
    exact_workloads: list[str] = knob(
        ["poisson"],
        lambda v: (
            None if v else "must name at least one workload (its exact vs padded replay is the headline comparison)"
        ),
        doc="also replayed with the exact (compile-on-first-sight) policy",
    )
    shared_prefix_tokens: int = knob(
        128, positive, "the shared_prefix workload (padded, prefix cache off vs on): the system prompt's length"
    )
    rate: float = knob(25.0, positive, "mean arrivals per second (poisson, bursty)")
    burst_cv: float = knob(3.0, positive, "bursty: coefficient of variation of inter-arrival gaps (Gamma)")
    prompt_tokens: list[int] = knob([8, 256], doc="[min, max] prompt length, log-uniform")
    output_tokens: list[int] = knob([8, 64], doc="[min, max] new tokens per request, log-uniform")
    temperature: float = knob(0.0, non_negative, "0 = greedy")
    top_p: float = knob(1.0, unit_interval, doc="nucleus sampling of the replayed requests (1 = off)")
    slo_ttft_s: float = knob(1.0, positive, "goodput: time to first token at most this")
    slo_tpot_s: float = knob(0.05, positive, "goodput: time per output token at most this")
    decode_contexts: list[int] = knob([2048, 8192], doc="prompt lengths for the decode-cost-vs-context check")
    decode_timing_steps: int = knob(64, positive, doc="decode steps timed at each decode context")
    max_decode_cost_ratio: float = knob(1.05, positive, "gate: decode cost at the longest / shortest context")
    live: bool = knob(True, doc="serve-check also serves the headline workload live (laplace serve + load generator)")
    live_startup_s: float = knob(300.0, positive, "serve-check's live phase: how long the server may take to warm up")
    seed: int = knob(0, doc="seeds the workloads (arrivals, lengths, prompt windows)")


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
