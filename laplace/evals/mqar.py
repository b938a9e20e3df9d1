"""MQAR (multi-query associative recall, Zoology-style, generated): key-value pairs at the
start of a sequence, the keys queried again later.

Scored through the compiled, padded serving path and through the eager parallel form (the
two must agree), and on a small GLA trained here on MQAR, so the probe is seen to measure
something: accuracy high with few pairs, falling as pairs outgrow the state.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from laplace.config import AdamWSection, MuonSection, ProbesSection, TrainSection
from laplace.errors import ConfigError
from laplace.model.config import ModelConfig, preset_model_config
from laplace.model.lm import LaplaceLM, analytic_state_bytes
from laplace.optim.muon_adamw import MuonAdamW
from laplace.progress import progress_bar
from laplace.serving.engine import DecodeEngine
from laplace.training.schedule import lr_scale

IGNORE = -100  # target of positions that are not scored (F.cross_entropy's ignore_index)


# --------------------------------------------------------------------------- MQAR data


def mqar_ranges(vocab_size: int, key_range=None, value_range=None) -> tuple[np.ndarray, range, range]:
    """(noise ids, key ids, value ids), disjoint.

    Defaults: values are the upper half of the vocabulary [V/2, V), keys the three
    eighths below [V/8, V/2), noise (the filler between queries) the lowest eighth
    [0, V/8). Given [start, stop) ranges are used as they are; noise is then every id
    in neither of them."""
    V = vocab_size
    keys = range(*key_range) if key_range is not None else range(V // 8, V // 2)
    values = range(*value_range) if value_range is not None else range(V // 2, V)
    for name, r in (("key_range", keys), ("value_range", values)):
        if r.start < 0 or r.stop > V or len(r) == 0:
            raise ValueError(f"MQAR {name} [{r.start}, {r.stop}) must be a non-empty part of the vocabulary [0, {V})")
    if keys.start < values.stop and values.start < keys.stop:
        raise ValueError(
            f"MQAR key ids [{keys.start}, {keys.stop}) and value ids [{values.start}, {values.stop}) overlap"
        )
    ids = np.arange(V)
    noise = ids[~(((ids >= keys.start) & (ids < keys.stop)) | ((ids >= values.start) & (ids < values.stop)))]
    return noise, keys, values


def mqar_batch(
    n: int,
    seq_len: int,
    pairs: int,
    vocab_size: int,
    rng: np.random.Generator | int = 0,
    key_range: tuple[int, int] | None = None,
    value_range: tuple[int, int] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """n MQAR sequences -> (tokens [n, L], targets [n, L], mask [n, L]).

    Layout of one sequence (see `mqar_ranges` for the id ranges):
      positions 0 .. 2*pairs-1:  k1 v1 k2 v2 ... (distinct keys, values drawn independently)
      the rest: each key once more, in random order, at a random position t, followed at t+1
      by its value; every other position holds a random noise id.
    At a query position t, targets[t] is the key's value (the language-model target of
    position t, i.e. tokens[t+1]) and mask[t] is True. Elsewhere mask is False and the
    target is IGNORE, so cross-entropy on (logits, targets) trains on the queries only.
    """
    if pairs < 1:
        raise ValueError(f"MQAR needs at least one key-value pair, got {pairs}")
    if seq_len < 4 * pairs:
        raise ValueError(
            f"MQAR sequence of {seq_len} tokens is too short for {pairs} pairs "
            f"(needs 4*pairs = {4 * pairs}: the pairs, then each key and its value again)"
        )
    noise, keys, values = mqar_ranges(vocab_size, key_range, value_range)
    if len(keys) < pairs:
        raise ValueError(f"MQAR vocab {vocab_size} is too small: {len(keys)} key ids for {pairs} distinct keys")
    if seq_len > 4 * pairs and len(noise) == 0:
        raise ValueError("MQAR key and value ranges cover the whole vocabulary: no id left for noise")
    rng = np.random.default_rng(rng) if not isinstance(rng, np.random.Generator) else rng

    region = seq_len - 2 * pairs  # where the queries go
    tokens = np.empty((n, seq_len), dtype=np.int64)
    targets = np.full((n, seq_len), IGNORE, dtype=np.int64)
    for i in range(n):
        k = keys.start + rng.choice(len(keys), size=pairs, replace=False)
        v = values.start + rng.integers(0, len(values), size=pairs)
        tokens[i] = noise[rng.integers(0, len(noise), size=seq_len)] if len(noise) else 0
        tokens[i, 0 : 2 * pairs : 2] = k
        tokens[i, 1 : 2 * pairs : 2] = v
        # Uniform non-overlapping placement of the 2-token query blocks: the region is a row of
        # `pairs` blocks and region - 2*pairs free cells, region - pairs items in all; choose which
        # items are blocks, then block j (the j-th chosen item) starts at item_j + j cells in.
        items = np.sort(rng.choice(region - pairs, size=pairs, replace=False))
        starts = 2 * pairs + items + np.arange(pairs)
        order = rng.permutation(pairs)
        tokens[i, starts] = k[order]
        tokens[i, starts + 1] = v[order]
        targets[i, starts] = v[order]
    targets_t = torch.from_numpy(targets)
    return torch.from_numpy(tokens), targets_t, targets_t != IGNORE


def mqar_chance(vocab_size: int, key_range=None, value_range=None) -> float:
    """Accuracy of guessing a value id uniformly."""
    return 1.0 / len(mqar_ranges(vocab_size, key_range, value_range)[2])


# --------------------------------------------------------------------------- scoring


def score(predictions: Tensor, targets: Tensor, mask: Tensor) -> float:
    """Fraction of masked positions whose prediction is the target."""
    return float((predictions[mask] == targets[mask]).float().mean()) if mask.any() else float("nan")


@torch.no_grad()
def mqar_predictions_eager(model, tokens: Tensor, batch: int = 16) -> Tensor:
    """Argmax of the full parallel forward at every position: [n, L].

    Runs under the force_eager stance: a served model's blocks may be compiled in place,
    and this path must neither compile new shapes nor use the serving graphs."""
    device = next(model.parameters()).device
    vocab = model.cfg.vocab_size if hasattr(model, "cfg") else model.vocab_size
    batch = max(1, min(batch, 2**24 // (tokens.shape[1] * vocab)))  # logits of a batch <= 64 MiB
    out = []
    with torch.compiler.set_stance("force_eager"):
        for i in range(0, tokens.shape[0], batch):
            out.append(model(tokens[i : i + batch].to(device)).argmax(-1).cpu())
    return torch.cat(out)


def mqar_accuracy_eager(model, tokens: Tensor, targets: Tensor, mask: Tensor) -> float:
    return score(mqar_predictions_eager(model, tokens), targets, mask)


@torch.inference_mode()
def mqar_predictions_serving(engine: DecodeEngine, tokens: Tensor, mask: Tensor) -> Tensor:
    """Argmax per position through the serving path: [n, L], -1 where nothing was computed.

    Per sample, the prefix before the first query is prefilled into a slot leased from the cache
    manager (the model runner's prefill: bucket pieces); the remaining tokens are fed one at a time
    with its decode_rows, up to the last query. Samples share decode steps, max_slots at a time, at
    the runner's width for them (pad rows on the dummy slot)."""
    n, L = tokens.shape
    first = mask.float().argmax(1)  # first query position of each sample
    last = L - 1 - mask.flip(1).float().argmax(1)
    if int(first.min()) < 1:
        raise ValueError("MQAR sequences must start with their key-value pairs (a query at position 0)")
    preds = torch.full((n, L), -1, dtype=torch.long)
    cache, runner = engine.cache, engine.runner
    for start in range(0, n, cache.max_slots):
        rows = list(range(start, min(n, start + cache.max_slots)))
        with cache.leased(-1 - r for r in rows) as leased:
            slots = dict(zip(rows, leased))
            cursor = {}
            for r in rows:  # prefill the prefix: positions 0 .. first-1
                p = int(first[r])
                preds[r, p - 1] = int(runner.prefill(slots[r], tokens[r, :p])[0].argmax())
                cursor[r] = p
            while live := [r for r in rows if cursor[r] <= int(last[r])]:
                top = runner.decode_rows([slots[r] for r in live], [int(tokens[r, cursor[r]]) for r in live]).argmax(-1)
                for r, token in zip(live, top.tolist()):
                    preds[r, cursor[r]] = token
                    cursor[r] += 1
    return preds


def mqar_accuracy_serving(engine: DecodeEngine, tokens: Tensor, targets: Tensor, mask: Tensor) -> float:
    return score(mqar_predictions_serving(engine, tokens, mask), targets, mask)


def argmax_agreement(a: Tensor, b: Tensor) -> float:
    """Fraction of positions computed by both (>= 0 in each) whose argmaxes agree."""
    both = (a >= 0) & (b >= 0)
    return float((a[both] == b[both]).float().mean()) if both.any() else float("nan")


class RecallOracle(torch.nn.Module):
    """A perfect-memory stand-in for a model: at each position it predicts the token that
    followed the first occurrence of the current token (at a query: the key's value), else
    token 0. Scores 100% on MQAR: the check that layout and scoring agree."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.anchor = torch.nn.Parameter(torch.zeros(()))  # gives the stub a device

    def forward(self, tokens: Tensor) -> Tensor:
        n, L = tokens.shape
        logits = torch.zeros(n, L, self.vocab_size)
        for i in range(n):
            seen: dict[int, int] = {}
            row = tokens[i].tolist()
            for t, tok in enumerate(row):
                if tok in seen:
                    logits[i, t, seen[tok]] = 1.0
                if t + 1 < L:
                    seen.setdefault(tok, row[t + 1])  # the first occurrence is the key-value pair
        return logits


class RandomGuesser(torch.nn.Module):
    """Guesses a value id uniformly at every position: scores chance on MQAR."""

    def __init__(self, vocab_size: int, values: range, seed: int = 0):
        super().__init__()
        self.vocab_size, self.values = vocab_size, values
        self.generator = torch.Generator().manual_seed(seed)
        self.anchor = torch.nn.Parameter(torch.zeros(()))

    def forward(self, tokens: Tensor) -> Tensor:
        guess = torch.randint(self.values.start, self.values.stop, tokens.shape, generator=self.generator)
        return F.one_hot(guess, self.vocab_size).float()


# --------------------------------------------------------------------------- MQAR training


def mqar_model_config(probes: ProbesSection, like: ModelConfig | None = None) -> ModelConfig:
    """The small model trained on MQAR (the knobs are `probes.mqar_train_*`): a GLA, or, `like` a
    model with attention or Gated DeltaNet layers, the same pattern at this size (`small_mqar_model`),
    so a hybrid's, a softmax or a GDN model's MQAR is measured on a model that learned the task."""
    return small_mqar_model(
        like,
        vocab_size=probes.mqar_train_vocab,
        d_model=probes.mqar_train_d_model,
        layers=probes.mqar_train_layers,
        heads=probes.mqar_train_heads,
        gate_bias=probes.mqar_train_gate_bias,
        seq_len=probes.mqar_train_seq_len,
        gdn_dt_init=probes.mqar_train_gdn_dt_init,
    )


def placed_attention_layers(like: ModelConfig, layers: int) -> list[int]:
    """`like`'s attention layers at the same relative depth in a model of `layers` layers (layer i of n
    -> floor(i * layers / n)). The family is kept: a hybrid stays a hybrid (where every layer would be
    attention, the lowest placed one stays GLA), so a shallow model can merge two hybrids' patterns,
    never turn one into a softmax model."""
    placed = sorted({i * layers // like.n_layers for i in like.attn_layers})
    if like.gla_layers and len(placed) == layers:
        placed = placed[1:]
    return placed


def small_mqar_model(
    like: ModelConfig | None,
    *,
    vocab_size: int,
    d_model: int,
    layers: int,
    heads: int,
    gate_bias: float,
    seq_len: int,
    gdn_dt_init: list[float] | None = None,
) -> ModelConfig:
    """A small model of `like`'s architecture (pure GLA where None) to train on MQAR: its attention
    layers placed by `placed_attention_layers`, its Gated DeltaNet layers by `placed_gdn_layers`, heads
    as given. A Gated DeltaNet layer has a GLA layer's key and value widths and heads (so the same
    recurrent state bytes: head_dim = d_model * expand_k / heads, expand_v = GLA's expand_v / expand_k)
    and its decays start from dt drawn in `gdn_dt_init` (model.gdn.dt_init_range; None: fla's init)."""
    chunk = min(64, seq_len)
    attn = None
    attn_layers = placed_attention_layers(like, layers) if like is not None and like.attn_layers else []
    if attn_layers:
        attn = {"layers": attn_layers, "num_heads": heads}
    gla = preset_model_config("tiny", vocab_size=vocab_size, d_model=d_model, n_layers=layers, n_heads=heads)
    gdn = None
    gdn_layers = placed_gdn_layers(like, layers, attn_layers) if like is not None and like.gdn_layers else []
    if gdn_layers:
        gdn = {
            "layers": gdn_layers,
            "num_heads": heads,
            "head_dim": gla.key_dim // heads,
            "expand_v": gla.value_dim / gla.key_dim,
        }
        if gdn_dt_init is not None:
            gdn["dt_init_range"] = list(gdn_dt_init)
    return preset_model_config(
        "tiny",
        vocab_size=vocab_size,
        d_model=d_model,
        n_layers=layers,
        n_heads=heads,
        gate_bias_init=gate_bias,
        chunk_size=chunk,
        sub_chunk_size=min(16, chunk),
        mlp_hidden=d_model,  # recall needs the GLA, not a wide MLP: steps 1.4x cheaper
        attn=attn,
        gdn=gdn,
    )


def placed_gdn_layers(like: ModelConfig, layers: int, attn_layers: list[int]) -> list[int]:
    """`like`'s Gated DeltaNet layers in a model of `layers` layers whose attention layers are
    `attn_layers`: with no GLA layer in `like` (a pure GDN model, or GDN + attention) every layer that is
    not attention; else each at the same relative depth (layer i of n -> floor(i * layers / n)), the
    lowest remaining layer kept GLA where that would leave none, so a GLA + GDN mix stays a mix."""
    free = [i for i in range(layers) if i not in attn_layers]
    if not like.gla_layers:
        return free
    placed = sorted({i * layers // like.n_layers for i in like.gdn_layers} & set(free))
    return placed[1:] if len(placed) == len(free) else placed


def state_floats(cfg: ModelConfig) -> int:
    """Numbers in the recurrent matrix state of one sequence (its GLA and Gated DeltaNet layers; the conv
    cache and attention K/V excluded)."""
    total = len(cfg.gla_layers) * cfg.n_heads * cfg.head_k_dim * cfg.head_v_dim
    if cfg.gdn_layers:
        d = cfg.gdn_dims()
        total += len(cfg.gdn_layers) * d["HV"] * d["Kh"] * d["Vh"]
    return total


@dataclass(frozen=True)
class MqarTraining:
    """How a model is trained on MQAR: batches mixing 1..top_pairs pairs at seq_len tokens, Muon on
    the matrices and AdamW on the rest (embeddings, gates, norms), a linear warmup then cosine to 0."""

    steps: int
    batch_size: int
    seq_len: int
    top_pairs: int
    muon_lr: float
    adamw_lr: float
    warmup_steps: int


def train_on_mqar(
    cfg: ModelConfig, how: MqarTraining, seed: int, progress: bool = True
) -> tuple[LaplaceLM, list[float]]:
    """A model of `cfg` trained on MQAR from seed `seed` (its initialisation and its batches):
    (the model in eval mode, the loss of every step). The loss is on the queries only."""
    torch.manual_seed(seed)
    model = LaplaceLM(cfg)
    optimizer = MuonAdamW(model, how.adamw_lr, AdamWSection(weight_decay=0.0), MuonSection(lr=how.muon_lr))
    rng = np.random.default_rng(seed)
    V = cfg.vocab_size
    # the training loop's schedule: a linear warmup, then cosine down to zero
    schedule = TrainSection(steps=how.steps, warmup_steps=how.warmup_steps, schedule="cosine", min_lr_ratio=0.0)
    model.train()
    bar = progress_bar(range(how.steps), desc="mqar train", unit="step", enabled=progress)
    losses = []
    for step in bar:
        optimizer.set_lr_scale(lr_scale(step, schedule))
        tokens, targets = _mixed_batch(how.batch_size, how.seq_len, how.top_pairs, V, rng)
        loss = F.cross_entropy(model(tokens).reshape(-1, V), targets.reshape(-1), ignore_index=IGNORE)
        loss.backward()
        # clipped to a global norm of 1 over the model's parameters in the model's order: the recall
        # thresholds were set on this rounding (the optimizer's own clip sums in route order, and
        # with it the trained recall at 4 pairs fell from >= 0.9 to 0.84; tests/test_probes.py)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    bar.close()
    model.eval()
    return model, losses


def train_mqar(probes: ProbesSection, seed: int, progress: bool = True, like: ModelConfig | None = None) -> dict:
    """Train a small GLA on MQAR, then measure accuracy per (context, pairs).

    Each batch mixes pair counts 1..mqar_train_pairs at mqar_train_seq_len; the loss is on
    the queries only. Evaluation uses fresh sequences (another seed stream) at every
    context in mqar_contexts and every pair count in mqar_pairs that fits (4*pairs <= context).

    Learning MQAR is a phase transition: the loss sits near ln(values) for ~150-250 steps,
    then drops within ~100 steps. Small batches (many updates per second) reach it soonest
    on a CPU; a cosine schedule that decays before it happens never gets there (300 steps
    stayed at chance, 600 reached ~0.97-1.0 on 4 pairs across seeds). The vocabulary matters:
    with 256 ids (128 values) 600 steps never left the plateau, with 64 they do. The forget-gate
    bias decides it too: with gate_bias 0 the same run ends near 0.2.
    """
    cfg = mqar_model_config(probes, like)
    if not _pair_counts(probes.mqar_train_seq_len, probes.mqar_train_pairs, probes.mqar_train_vocab):
        raise ConfigError(
            f"probes.mqar_train_seq_len={probes.mqar_train_seq_len} holds no MQAR pair (needs >= 4 tokens per pair)"
        )
    V = probes.mqar_train_vocab
    start = time.perf_counter()
    model, losses = train_on_mqar(
        cfg,
        MqarTraining(
            steps=probes.mqar_train_steps,
            batch_size=probes.mqar_train_batch_size,
            seq_len=probes.mqar_train_seq_len,
            top_pairs=probes.mqar_train_pairs,
            muon_lr=probes.mqar_train_muon_lr,
            adamw_lr=probes.mqar_train_lr,
            warmup_steps=probes.mqar_train_warmup_steps,
        ),
        seed,
        progress,
    )
    L, top = probes.mqar_train_seq_len, probes.mqar_train_pairs
    train_seconds = time.perf_counter() - start
    accuracy = mqar_grid(model, probes.mqar_contexts, probes.mqar_pairs, probes.mqar_samples, V, seed + 1)
    return {
        "accuracy": accuracy,
        "state_floats": state_floats(cfg),
        "state_bytes": analytic_state_bytes(cfg),
        "train_seconds": train_seconds,
        "eval_seconds": time.perf_counter() - start - train_seconds,
        "final_loss": float(np.mean(losses[-20:])),  # the last steps' mean: one batch is noisy
        "chance": mqar_chance(V),
        "trained_model": model,  # for the recall suite through the serving engine (popped before JSON)
        "train_seq_len": L,
        "train_pairs": top,
        "model": cfg.to_dict(),
    }


def _pair_counts(seq_len: int, top_pairs: int, vocab: int) -> list[int]:
    """Pair counts 1..top_pairs that fit the sequence and the vocabulary's key ids."""
    n_keys = len(mqar_ranges(vocab)[1])
    return [p for p in range(1, top_pairs + 1) if 4 * p <= seq_len and p <= n_keys]


def _mixed_batch(batch_size: int, seq_len: int, top_pairs: int, vocab: int, rng) -> tuple[Tensor, Tensor]:
    """A batch whose rows have 1..top_pairs pairs (equal shares), for one training step."""
    counts = _pair_counts(seq_len, top_pairs, vocab)
    share = np.array_split(np.arange(batch_size), len(counts))
    parts = [mqar_batch(len(rows), seq_len, p, vocab, rng) for p, rows in zip(counts, share) if len(rows)]
    return torch.cat([t for t, _, _ in parts]), torch.cat([y for _, y, _ in parts])


@torch.no_grad()
def mqar_grid(model, contexts: list[int], pairs: list[int], samples: int, vocab: int, seed: int) -> dict:
    """Eager MQAR accuracy {context: {pairs: acc}}; cells where the pairs do not fit the context
    (4*pairs > context) or the vocabulary's key ids are left out."""
    n_keys = len(mqar_ranges(vocab)[1])
    out: dict[int, dict[int, float]] = {}
    for ctx in contexts:
        for p in pairs:
            if 4 * p > ctx or p > n_keys:
                continue
            tokens, targets, mask = mqar_batch(samples, ctx, p, vocab, np.random.default_rng([seed, ctx, p]))
            out.setdefault(ctx, {})[p] = mqar_accuracy_eager(model, tokens, targets, mask)
    return out


def mqar_both_paths(
    model: LaplaceLM,
    engine: DecodeEngine,
    contexts: list[int],
    pairs: list[int],
    samples: int,
    seed: int,
    progress: bool = True,
) -> dict:
    """MQAR on one model through the serving path and the eager forward, on the same sequences.

    Contexts longer than the largest prefill bucket run eagerly only, with a note: the serving
    path could take them (long prefixes go in pieces), but decoding every token after the first
    query one step at a time is what makes this probe slow. Accuracies are {context: {pairs:
    acc}}; agreement is over every position both paths computed."""
    vocab = model.cfg.vocab_size
    largest = max(engine.runner.buckets)
    serving: dict[int, dict[int, float]] = {}
    eager: dict[int, dict[int, float]] = {}
    same, total, notes = 0, 0, []
    cells = [(c, p) for c in contexts for p in pairs if 4 * p <= c]
    for ctx, p in progress_bar(cells, desc="mqar", unit="cell", enabled=progress):
        tokens, targets, mask = mqar_batch(samples, ctx, p, vocab, np.random.default_rng([seed, ctx, p]))
        eager_preds = mqar_predictions_eager(model, tokens)
        eager.setdefault(ctx, {})[p] = score(eager_preds, targets, mask)
        if ctx > largest:
            if not any(f"context {ctx}" in n for n in notes):
                notes.append(f"MQAR context {ctx}: longer than the largest prefill bucket {largest}; eager path only")
            continue
        served = mqar_predictions_serving(engine, tokens, mask)
        serving.setdefault(ctx, {})[p] = score(served, targets, mask)
        both = served >= 0
        same += int((served[both] == eager_preds[both]).sum())
        total += int(both.sum())
    return {
        "serving": serving,
        "eager": eager,
        "agreement": same / total if total else float("nan"),
        "positions_compared": total,
        "notes": notes,
    }
