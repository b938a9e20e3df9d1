"""Retrieval probes and memory accounting (the probes stage).

A GLA keeps a fixed-size recurrent state, so its history is compressed: "fits in
memory" is not "recalls accurately", and retrieval has to be measured per workload.
This module measures it three ways and puts the memory figures next to it:

- MQAR (multi-query associative recall, Zoology-style, generated): key-value pairs
  at the start of a sequence, the keys queried again later. Run on the exported model
  through the compiled, padded serving path and through the eager parallel form (the
  two must agree), and on a small GLA trained here on MQAR, so the probe is seen to
  measure something (accuracy high with few pairs, falling as pairs outgrow the state).
- Passkey: a 5-digit number hidden at some depth of real text, asked for at the end.
- Memory: state bytes measured from the live State tensors vs the formula, the KV
  cache a same-size transformer would need, process RSS while decoding after
  growing contexts (flat for a GLA), and the Laplace 3B figures.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from laplace.config import (AdamWSection, Config, ModelConfig, MuonSection, ProbesSection,
                            preset_model_config)
from laplace.model.lm import LaplaceLM, State, analytic_state_bytes, kv_cache_bytes, torch_dtype
from laplace.optim.muon import MuonAdamW
from laplace.serve import DecodeEngine, fit
from laplace.worker import run_worker_from_warmup_cache, worker_main

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
        raise ValueError(f"MQAR key ids [{keys.start}, {keys.stop}) and value ids "
                         f"[{values.start}, {values.stop}) overlap")
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
        raise ValueError(f"MQAR sequence of {seq_len} tokens is too short for {pairs} pairs "
                         f"(needs 4*pairs = {4 * pairs}: the pairs, then each key and its value again)")
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
        tokens[i, 0:2 * pairs:2] = k
        tokens[i, 1:2 * pairs:2] = v
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
            out.append(model(tokens[i:i + batch].to(device)).argmax(-1).cpu())
    return torch.cat(out)


def mqar_accuracy_eager(model, tokens: Tensor, targets: Tensor, mask: Tensor) -> float:
    return score(mqar_predictions_eager(model, tokens), targets, mask)


@torch.inference_mode()
def mqar_predictions_serving(engine: DecodeEngine, tokens: Tensor, mask: Tensor) -> Tensor:
    """Argmax per position through the serving path: [n, L], -1 where nothing was computed.

    Per sample, the prefix before the first query is prefilled into a pool slot at a
    prefill bucket (right-padded); the remaining tokens are fed one at a time with
    decode_rows, up to the last query. Samples share decode steps, max_slots at a time,
    at the ladder width that holds them; pad rows run on the dummy slot."""
    n, L = tokens.shape
    device = engine.device
    first = mask.float().argmax(1)  # first query position of each sample
    last = L - 1 - mask.flip(1).float().argmax(1)
    if int(first.max()) > max(engine.buckets):
        raise ValueError(f"MQAR prefix of {int(first.max())} tokens does not fit the largest prefill bucket "
                         f"{max(engine.buckets)}")
    if int(first.min()) < 1:
        raise ValueError("MQAR sequences must start with their key-value pairs (a query at position 0)")
    preds = torch.full((n, L), -1, dtype=torch.long)
    for start in range(0, n, engine.max_slots):
        rows = list(range(start, min(n, start + engine.max_slots)))
        slots = {r: engine.pool.acquire(-1 - r) for r in rows}
        try:
            cursor = {}
            for r in rows:  # prefill the prefix: positions 0 .. first-1
                p = int(first[r])
                bucket = fit(p, engine.buckets)
                prompt = torch.full((1, bucket), engine.pad_id, dtype=torch.long)
                prompt[0, :p] = tokens[r, :p]
                slot = torch.tensor([slots[r]], device=device)
                engine.state.zero_(slot)
                logits = engine.prefill_rows(prompt.to(device), slot, torch.tensor([p], device=device))
                preds[r, p - 1] = int(logits[0].argmax())
                cursor[r] = p
            while True:
                live = [r for r in rows if cursor[r] <= int(last[r])]
                if not live:
                    break
                width = fit(len(live), engine.ladder)
                pad = width - len(live)
                step_tokens = torch.tensor([int(tokens[r, cursor[r]]) for r in live] + [engine.pad_id] * pad)
                step_slots = torch.tensor([slots[r] for r in live] + [engine.pool.dummy] * pad)
                logits = engine.decode_rows(step_tokens.to(device), step_slots.to(device))
                top = logits[: len(live)].argmax(-1).cpu()
                for j, r in enumerate(live):
                    preds[r, cursor[r]] = top[j]
                    cursor[r] += 1
        finally:
            for r in rows:
                engine.pool.release(slots[r])
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


def mqar_model_config(probes: ProbesSection) -> ModelConfig:
    """The small GLA trained on MQAR (the knobs are `probes.mqar_train_*`)."""
    chunk = min(64, probes.mqar_train_seq_len)
    return preset_model_config(
        "tiny", vocab_size=probes.mqar_train_vocab, d_model=probes.mqar_train_d_model,
        n_layers=probes.mqar_train_layers, n_heads=probes.mqar_train_heads,
        gate_bias_init=probes.mqar_train_gate_bias, chunk_size=chunk, sub_chunk_size=min(16, chunk),
        mlp_hidden=probes.mqar_train_d_model,  # recall needs the GLA, not a wide MLP: steps 1.4x cheaper
    )


def state_floats(cfg: ModelConfig) -> int:
    """Numbers in the recurrent matrix state of one sequence (all layers; the conv cache excluded)."""
    return cfg.n_layers * cfg.n_heads * cfg.head_k_dim * cfg.head_v_dim


def train_mqar(probes: ProbesSection, seed: int, progress: bool = True) -> dict:
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
    torch.manual_seed(seed)
    cfg = mqar_model_config(probes)
    model = LaplaceLM(cfg)
    optimizer = MuonAdamW(model, probes.mqar_train_lr, AdamWSection(weight_decay=0.0),
                          MuonSection(lr=probes.mqar_train_muon_lr))
    batch_size, warmup_steps = probes.mqar_train_batch_size, probes.mqar_train_warmup_steps
    rng = np.random.default_rng(seed)
    L, V, top = probes.mqar_train_seq_len, probes.mqar_train_vocab, probes.mqar_train_pairs
    steps = probes.mqar_train_steps
    start = time.perf_counter()
    model.train()
    if not _pair_counts(L, top, V):
        raise ValueError(f"probes.mqar_train_seq_len={L} holds no MQAR pair (needs >= 4 tokens per pair)")
    bar = tqdm(range(steps), desc="mqar train", unit="step", disable=not progress, dynamic_ncols=True)
    losses = []
    for step in bar:
        # cosine schedule after a linear warmup
        scale = (step + 1) / warmup_steps if step < warmup_steps else \
            0.5 * (1 + math.cos(math.pi * (step - warmup_steps) / max(1, steps - warmup_steps)))
        optimizer.set_lr_scale(scale)
        tokens, targets = _mixed_batch(batch_size, L, top, V, rng)
        loss = F.cross_entropy(model(tokens).reshape(-1, V), targets.reshape(-1), ignore_index=IGNORE)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    bar.close()
    train_seconds = time.perf_counter() - start
    model.eval()
    accuracy = mqar_grid(model, probes.mqar_contexts, probes.mqar_pairs, probes.mqar_samples, V, seed + 1)
    return {
        "accuracy": accuracy,
        "state_floats": state_floats(cfg),
        "state_bytes": analytic_state_bytes(cfg),
        "train_seconds": train_seconds,
        "eval_seconds": time.perf_counter() - start - train_seconds,
        "final_loss": float(np.mean(losses[-20:])),  # the last steps' mean: one batch is noisy
        "chance": mqar_chance(V),
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


# --------------------------------------------------------------------------- long prompts


@torch.inference_mode()
def prefill_long(engine: DecodeEngine, prompt_ids, slot: int) -> Tensor:
    """Prefill a prompt of any length into a clean `slot`; returns the last token's logits [1, V].

    Prompts longer than the largest prefill bucket go in chunks: full chunks of the largest
    bucket, then the rest right-padded to the smallest bucket that holds it. Each chunk
    continues the slot's state (prefill reads and writes it; padding is an exact no-op), so
    only the warmed-up bucket graphs run, whatever the context length, and the result equals
    one prefill of the whole prompt."""
    ids = torch.as_tensor(np.asarray(prompt_ids, dtype=np.int64))
    if ids.numel() == 0:
        raise ValueError("prompt is empty: at least one token is needed")
    device = engine.device
    slots = torch.tensor([slot], device=device)
    engine.state.zero_(slots)
    largest = max(engine.buckets)
    logits = None
    for start in range(0, ids.numel(), largest):
        chunk = ids[start:start + largest]
        n = chunk.numel()
        bucket = fit(n, engine.buckets)
        padded = torch.full((1, bucket), engine.pad_id, dtype=torch.long)
        padded[0, :n] = chunk
        logits = engine.prefill_rows(padded.to(device), slots, torch.tensor([n], device=device))
    return logits


@torch.inference_mode()
def greedy_continue(engine: DecodeEngine, logits: Tensor, slot: int, new_tokens: int) -> list[int]:
    """Greedy tokens after a prefill of `slot`, one decode step at a time at the smallest
    ladder width (pad rows, if that width is > 1, run on the dummy slot)."""
    width = fit(1, engine.ladder)
    slots = torch.tensor([slot] + [engine.pool.dummy] * (width - 1), device=engine.device)
    out = [int(logits[0].argmax())]
    while len(out) < new_tokens:
        tokens = torch.tensor([out[-1]] + [engine.pad_id] * (width - 1), device=engine.device)
        out.append(int(engine.decode_rows(tokens, slots)[0].argmax()))
    return out


# --------------------------------------------------------------------------- passkey

PASSKEY_NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = " What is the pass key? The pass key is"


def passkey_prompt(tokenizer, haystack: np.ndarray, context: int, depth: float, key: int,
                   rng: np.random.Generator) -> list[int]:
    """About `context` tokens: real text with the needle sentence inserted at `depth` (a
    fraction of the filler), then the question. The filler is a random window of the haystack
    (repeated if the haystack is shorter)."""
    needle = tokenizer.encode(PASSKEY_NEEDLE.format(key=key)).ids
    question = tokenizer.encode(PASSKEY_QUESTION).ids
    filler_len = context - len(needle) - len(question)
    if filler_len < 0:
        raise ValueError(f"passkey context {context} is shorter than the needle and question "
                         f"({len(needle) + len(question)} tokens)")
    start = int(rng.integers(0, max(1, len(haystack) - filler_len)))
    filler = np.resize(np.asarray(haystack[start:start + filler_len], dtype=np.int64), filler_len).tolist()
    at = int(round(depth * filler_len))
    return filler[:at] + needle + filler[at:] + question


def passkey_found(text: str, key: int) -> bool:
    """The key's digits appear in the generated text (spaces between digit tokens ignored)."""
    return str(key) in text.replace(" ", "")


def passkey_probe(engine: DecodeEngine, tokenizer, haystack_tokens, contexts: list[int], depths: list[float],
                  samples: int, seed: int, new_tokens: int = 8, progress: bool = True) -> dict:
    """Greedy passkey retrieval through the engine: found when the 5 digits appear in the
    first `new_tokens` generated tokens. Each prompt gets a pool slot, is prefilled through the
    bucket graphs (in chunks when longer than the largest bucket: see prefill_long, so a
    4,096-token context needs no new shape) and decoded at the smallest ladder width.
    Returns accuracy per context, per depth, per (context, depth), overall, and the table."""
    rng = np.random.default_rng(seed)
    haystack = np.asarray(haystack_tokens)
    if len(haystack) == 0:
        raise ValueError("passkey haystack is empty")
    rows = []
    cells = [(c, d, s) for c in contexts for d in depths for s in range(samples)]
    for ctx, depth, _ in tqdm(cells, desc="passkey", unit="prompt", disable=not progress, dynamic_ncols=True):
        key = int(rng.integers(10000, 100000))
        prompt = passkey_prompt(tokenizer, haystack, ctx, depth, key, rng)
        slot = engine.pool.acquire(-1)
        try:
            output = greedy_continue(engine, prefill_long(engine, prompt, slot), slot, new_tokens)
        finally:
            engine.pool.release(slot)
        text = tokenizer.decode(output)
        rows.append({"context": ctx, "depth": depth, "key": key, "prompt_tokens": len(prompt),
                     "found": passkey_found(text, key), "output": text})

    def share(select):
        hits = [r["found"] for r in rows if select(r)]
        return sum(hits) / len(hits) if hits else float("nan")

    return {
        "accuracy": {c: share(lambda r, c=c: r["context"] == c) for c in contexts},
        "accuracy_by_depth": {d: share(lambda r, d=d: r["depth"] == d) for d in depths},
        "accuracy_grid": {c: {d: share(lambda r, c=c, d=d: (r["context"], r["depth"]) == (c, d)) for d in depths}
                          for c in contexts},
        "accuracy_overall": share(lambda r: True),
        "table": rows,
    }


# --------------------------------------------------------------------------- memory


def rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def meta_facts(cfg: ModelConfig) -> dict:
    """Parameters and state bytes from the real modules on the meta device (nothing allocated)."""
    with torch.device("meta"):
        model = LaplaceLM(cfg)
    state = State.allocate(cfg, batch=1, device="meta", dtype=torch_dtype(cfg.dtype))
    return {"params": model.num_parameters(), "state_bytes": state.bytes_per_sequence,
            "state_bytes_analytic": analytic_state_bytes(cfg)}


@torch.inference_mode()
def decode_rss(engine: DecodeEngine, contexts: list[int], decode_steps: int = 16, text=None,
               progress: bool = True) -> dict[int, int]:
    """Process RSS while decoding at width 1 after a prompt of each context length.

    The prompt (repeated `text`, or a fixed token) is prefilled in bucket chunks into one
    slot; the highest RSS seen over `decode_steps` greedy decode steps is recorded. A GLA
    decodes from a fixed-size state, so this should not grow with the context."""
    out = {}
    source = np.asarray(text if text is not None and len(text) else [engine.pad_id], dtype=np.int64)
    for ctx in tqdm(contexts, desc="decode memory", unit="context", disable=not progress, dynamic_ncols=True):
        prompt = np.resize(source, ctx)
        slot = engine.pool.acquire(-1)
        try:
            logits = prefill_long(engine, prompt, slot)
            token = torch.tensor([int(logits[0].argmax())], device=engine.device)
            width = fit(1, engine.ladder)
            slots = torch.tensor([slot] + [engine.pool.dummy] * (width - 1), device=engine.device)
            pad = torch.full((width - 1,), engine.pad_id, dtype=torch.long, device=engine.device)
            peak = 0
            for _ in range(decode_steps):
                token = engine.decode_rows(torch.cat([token, pad]), slots)[:1].argmax(-1)
                peak = max(peak, rss_bytes())
            out[ctx] = peak
        finally:
            engine.pool.release(slot)
    return out


def memory_report(model: LaplaceLM, engine: DecodeEngine, contexts: list[int], kv_contexts: list[int],
                  cfg_3b: ModelConfig | None = None, decode_steps: int = 16, text=None,
                  progress: bool = True) -> dict:
    """State bytes (measured vs formula), the KV cache of a same-size transformer, decode RSS vs
    context, and the Laplace 3B figures (modules on the meta device, nothing allocated)."""
    cfg = model.cfg
    cfg_3b = cfg_3b or preset_model_config("laplace-3b")
    dtype = next(model.parameters()).dtype
    rss = decode_rss(engine, contexts, decode_steps, text, progress) if contexts else {}
    facts_3b = meta_facts(cfg_3b)
    kv_3b_8192 = kv_cache_bytes(cfg_3b, 8192)
    return {
        "state_bytes_measured": engine.state.bytes_per_sequence,
        "state_bytes_analytic": analytic_state_bytes(cfg, dtype),
        "kv_bytes": {c: kv_cache_bytes(cfg, c) for c in kv_contexts},
        "kv_bytes_8192": kv_cache_bytes(cfg, 8192),
        "decode_rss_bytes": rss,
        "decode_rss_flat_ratio": max(rss.values()) / min(rss.values()) if rss else None,
        "laplace_3b_params": facts_3b["params"],
        "laplace_3b_state_bytes": facts_3b["state_bytes"],
        "laplace_3b_state_bytes_analytic": facts_3b["state_bytes_analytic"],
        "laplace_3b_kv_bytes_8192": kv_3b_8192,
        "laplace_3b_state_vs_kv_8192": kv_3b_8192 / facts_3b["state_bytes"],
        # for the plot: the two configurations the curves are drawn for
        "model_config": cfg.to_dict(),
        "laplace_3b_config": cfg_3b.to_dict(),
    }


# --------------------------------------------------------------------------- plots


def memory_plot(report: dict, path: Path) -> None:
    """Bytes per sequence vs context: the GLA state (flat) and a same-size transformer's KV cache
    (linear), for the probed model and for Laplace 3B (log axes); next to it, measured RSS
    while decoding after each context."""
    import matplotlib.pyplot as plt

    from laplace.plots import save_figure

    measured = {int(c): v for c, v in (report.get("decode_rss_bytes") or {}).items()}
    kv_ctx = [int(c) for c in report.get("kv_bytes", {})]
    top = max(kv_ctx + list(measured) + [32768])
    contexts = [2 ** i for i in range(7, top.bit_length()) if 2 ** i <= top] + [top]
    contexts = sorted(set(contexts))
    fig, (ax, ax_rss) = plt.subplots(1, 2, figsize=(11, 4.0))
    for key, label, color in (("model_config", "probed model", "tab:blue"),
                              ("laplace_3b_config", "Laplace 3B", "tab:red")):
        cfg = ModelConfig(**report[key])
        state = report["state_bytes_measured"] if key == "model_config" else report["laplace_3b_state_bytes"]
        ax.plot(contexts, [state] * len(contexts), "-", color=color, label=f"{label}: GLA state")
        ax.plot(contexts, [kv_cache_bytes(cfg, c) for c in contexts], "--", color=color,
                label=f"{label}: transformer KV (bf16)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("bytes per sequence")
    ax.set_title(f"3B: KV at 8,192 = {report['laplace_3b_state_vs_kv_8192']:.0f}x the state")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    if measured:
        xs = sorted(measured)
        ax_rss.plot(xs, [measured[c] / 2**20 for c in xs], "o-", color="tab:blue")
        ax_rss.set_ylim(0, max(measured.values()) / 2**20 * 1.2)
    ax_rss.set_xscale("log", base=2)
    ax_rss.set_xlabel("context before decoding (tokens)")
    ax_rss.set_ylabel("process RSS while decoding (MiB)")
    ratio = report.get("decode_rss_flat_ratio")
    ax_rss.set_title(f"decode memory vs context (max/min {ratio:.3f})" if ratio else "decode memory vs context")
    ax_rss.grid(alpha=0.3)
    save_figure(fig, path)


def accuracy_plot(result: dict, path: Path) -> None:
    """The trained MQAR model: accuracy vs context (a line per pair count) and vs pairs (a line
    per context), chance dashed."""
    import matplotlib.pyplot as plt

    from laplace.plots import save_figure

    grid = {int(c): {int(p): a for p, a in row.items()} for c, row in result["accuracy"].items()}
    contexts = sorted(grid)
    pairs = sorted({p for row in grid.values() for p in row})
    fig, (ax_ctx, ax_pairs) = plt.subplots(1, 2, figsize=(11, 4.0), sharey=True)
    for p in pairs:
        xs = [c for c in contexts if p in grid[c]]
        ax_ctx.plot(xs, [grid[c][p] for c in xs], "o-", label=f"{p} pairs")
    for c in contexts:
        xs = sorted(grid[c])
        ax_pairs.plot(xs, [grid[c][p] for p in xs], "o-", label=f"context {c}")
    for ax in (ax_ctx, ax_pairs):
        if result.get("chance"):
            ax.axhline(result["chance"], color="gray", ls="--", lw=1, label="chance")
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_ctx.set_xlabel("context length (tokens)")
    ax_ctx.set_ylabel("MQAR accuracy")
    ax_pairs.set_xlabel("key-value pairs")
    if result.get("state_floats"):
        title = (f"MQAR, a GLA trained here on <= {result['train_pairs']} pairs at {result['train_seq_len']} "
                 f"tokens (state {result['state_floats']:,} floats per sequence)")
    else:
        title = "MQAR"
    fig.suptitle(title)
    save_figure(fig, path)


# --------------------------------------------------------------------------- the stage

PATHS_AGREE_MIN = 0.99  # argmax agreement of the serving and eager paths for them to "agree"


def mqar_both_paths(model: LaplaceLM, engine: DecodeEngine, contexts: list[int], pairs: list[int], samples: int,
                    seed: int, progress: bool = True) -> dict:
    """MQAR on one model through the serving path and the eager forward, on the same sequences.

    Contexts whose query prefix could exceed the largest prefill bucket (context > bucket) run
    eagerly only, with a note. Accuracies are {context: {pairs: acc}}; agreement is over every
    position both paths computed."""
    vocab = model.cfg.vocab_size
    largest = max(engine.buckets)
    serving: dict[int, dict[int, float]] = {}
    eager: dict[int, dict[int, float]] = {}
    same, total, notes = 0, 0, []
    cells = [(c, p) for c in contexts for p in pairs if 4 * p <= c]
    for ctx, p in tqdm(cells, desc="mqar", unit="cell", disable=not progress, dynamic_ncols=True):
        tokens, targets, mask = mqar_batch(samples, ctx, p, vocab, np.random.default_rng([seed, ctx, p]))
        eager_preds = mqar_predictions_eager(model, tokens)
        eager.setdefault(ctx, {})[p] = score(eager_preds, targets, mask)
        if ctx > largest:
            if not any(f"context {ctx}" in n for n in notes):
                notes.append(f"MQAR context {ctx}: a prefix may exceed the largest prefill bucket {largest}; "
                             "eager path only")
            continue
        served = mqar_predictions_serving(engine, tokens, mask)
        serving.setdefault(ctx, {})[p] = score(served, targets, mask)
        both = served >= 0
        same += int((served[both] == eager_preds[both]).sum())
        total += int(both.sum())
    return {"serving": serving, "eager": eager, "agreement": same / total if total else float("nan"),
            "positions_compared": total, "notes": notes}


def _str_keys(obj):
    """JSON-friendly: dict keys as strings, all the way down."""
    if isinstance(obj, dict):
        return {str(k): _str_keys(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_str_keys(v) for v in obj]
    return obj


def run_probes(cfg: Config, export_dir: Path, data_dir: Path, plots_dir: Path, progress: bool = True) -> dict:
    """The probes stage: MQAR (serving vs eager) and passkey on the exported model, memory
    accounting, MQAR on a GLA trained here; writes plots/probes_mqar.png, probes_memory.png and
    their data (probes_mqar.json, probes_passkey.json). Returns the metrics.

    `passed` is true when the serving and eager MQAR paths agree and the measured state bytes
    equal the formula; retrieval quality is reported, not gated on."""
    from laplace.data import open_split
    from laplace.export import load_export
    from laplace.plots import write_rows
    from laplace.runtime import compile_backend, configure_compiler, resolve_device

    p = cfg.probes
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    device = resolve_device(cfg.serve.device)
    model, tokenizer, _ = load_export(export_dir, device=device)
    engine = DecodeEngine.for_policy(model, cfg.serve, "padded", compile_backend(device))
    configure_compiler(engine.graphs_needed() + 8)
    engine.warmup()
    # Pad rows read and write the dummy slot: NaN there makes any leak into a real row visible.
    dummy = engine.pool.dummy
    engine.state.recurrent[:, dummy] = float("nan")
    if engine.state.conv is not None:
        engine.state.conv[:, dummy] = float("nan")
    seconds["load_and_warmup"] = time.perf_counter() - start

    # The exported model is probed at the easiest pair count only (it is a text model: if it cannot
    # recall 4 pairs it cannot recall 16); decoding every context token one step at a time is the
    # costly part. The trained MQAR model below covers the whole (context, pairs) grid.
    t = time.perf_counter()
    exported_pairs = [min(p.mqar_pairs)]
    with torch.compiler.set_stance("fail_on_recompile"):  # serving runs the warmed-up graphs only
        mqar = mqar_both_paths(model, engine, p.mqar_contexts, exported_pairs, p.mqar_samples, p.seed, progress)
    seconds["mqar_exported"] = time.perf_counter() - t
    served_cells = [(c, q) for c in mqar["serving"] for q in mqar["serving"][c]]
    max_gap = max((abs(mqar["serving"][c][q] - mqar["eager"][c][q]) for c, q in served_cells), default=0.0)
    paths_agree = bool(served_cells) and mqar["agreement"] >= PATHS_AGREE_MIN and max_gap <= 1 - PATHS_AGREE_MIN

    t = time.perf_counter()
    haystack = np.asarray(open_split(data_dir, "val"))
    with torch.compiler.set_stance("fail_on_recompile"):
        passkey = passkey_probe(engine, tokenizer, haystack, p.passkey_contexts, p.passkey_depths,
                                p.passkey_samples, p.seed, progress=progress)
    seconds["passkey"] = time.perf_counter() - t

    t = time.perf_counter()
    with torch.compiler.set_stance("fail_on_recompile"):
        memory = memory_report(model, engine, p.memory_contexts, p.kv_contexts,
                               text=haystack[: max(p.memory_contexts, default=0)], progress=progress)
    seconds["memory"] = time.perf_counter() - t
    if engine.pool.owners:
        raise RuntimeError(f"probe slots still owned after the probes: {engine.pool.owners}")

    q = exported_pairs[0]
    best_path = {c: mqar["serving"].get(c, grid) for c, grid in mqar["eager"].items()}  # serving where it ran
    metrics: dict = {
        "mqar_accuracy": {c: grid[q] for c, grid in best_path.items()},
        "mqar_accuracy_eager": {c: grid[q] for c, grid in mqar["eager"].items()},
        "mqar_exported_pairs": exported_pairs[0],
        "mqar_chance": mqar_chance(model.cfg.vocab_size),
        "mqar_serving_vs_eager_agreement": mqar["agreement"],
        "mqar_positions_compared": mqar["positions_compared"],
        "mqar_paths_agree": paths_agree,
        "passkey_accuracy": passkey["accuracy"],
        "passkey_accuracy_by_depth": passkey["accuracy_by_depth"],
        "passkey_accuracy_overall": passkey["accuracy_overall"],
        **{k: v for k, v in memory.items() if not k.endswith("config")},
        "state_bytes_match": memory["state_bytes_measured"] == memory["state_bytes_analytic"],
        "notes": list(mqar["notes"]),
    }

    plots_dir = Path(plots_dir)
    if p.train_mqar:
        t = time.perf_counter()
        trained = train_mqar(p, p.seed, progress=progress)
        seconds["mqar_train_and_eval"] = time.perf_counter() - t
        metrics.update({
            "mqar_trained_accuracy": trained["accuracy"],
            "mqar_trained_chance": trained["chance"],
            "mqar_trained_state_floats": trained["state_floats"],
            "mqar_trained_state_bytes": trained["state_bytes"],
            "mqar_trained_train_seconds": trained["train_seconds"],
            "mqar_trained_final_loss": trained["final_loss"],
        })
        accuracy_plot(trained, plots_dir / "probes_mqar.png")
        write_rows(plots_dir / "probes_mqar.json",
                   [{"context": c, "pairs": n, "accuracy": a} for c, row in trained["accuracy"].items()
                    for n, a in row.items()])
    else:  # the plot still exists (a declared output), drawn for the exported model
        metrics["notes"].append("probes.train_mqar is false: probes_mqar.png shows the exported model")
        accuracy_plot({"accuracy": best_path, "chance": metrics["mqar_chance"]},
                      plots_dir / "probes_mqar.png")
    memory_plot(memory, plots_dir / "probes_memory.png")
    write_rows(plots_dir / "probes_passkey.json", passkey["table"])

    metrics["passed"] = bool(paths_agree and metrics["state_bytes_match"])
    seconds["total"] = time.perf_counter() - start
    metrics["seconds"] = seconds
    return _str_keys(metrics)


# --------------------------------------------------------------------------- worker and stage


def main(argv: list[str] | None = None) -> int:
    return worker_main(
        "probes worker", lambda cfg, args: run_probes(cfg, args.export_dir, args.data_dir, args.plots_dir), argv,
        paths=("export-dir", "data-dir", "plots-dir"),
    )


def probes_stage(cfg: Config, export_dir: Path, data_dir: Path, warmup_cache: Path, plots_dir: Path) -> dict:
    """run_probes in a fresh process started from a copy of the warmup compile cache (the serving
    graphs are the ones warmup compiled)."""
    args = ["--export-dir", str(export_dir), "--data-dir", str(data_dir), "--plots-dir", str(plots_dir)]
    return run_worker_from_warmup_cache("laplace.probes", cfg, args, warmup_cache)


if __name__ == "__main__":
    import sys

    sys.exit(main())
