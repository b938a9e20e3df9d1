"""Probes: the MQAR generator's layout, scoring against an oracle and chance, serving vs eager
paths (pad rows as NaN), chunked long prefills, passkey prompts, memory accounting, and an MQAR
training run that learns (slow)."""

import copy
import dataclasses
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from laplace.config import EngineSection, ProbesSection, config_from_dict
from laplace.data.tokenize import tokenize_corpus
from laplace.evals.memory import decode_rss, memory_report
from laplace.evals.mqar import (
    IGNORE,
    RandomGuesser,
    RecallOracle,
    argmax_agreement,
    mqar_accuracy_eager,
    mqar_accuracy_serving,
    mqar_batch,
    mqar_chance,
    mqar_predictions_eager,
    mqar_predictions_serving,
    mqar_ranges,
    score,
    train_mqar,
)
from laplace.evals.passkey import passkey_found, passkey_probe, passkey_prompt, prefill_long
from laplace.model.config import preset_model_config
from laplace.model.export import export_model
from laplace.model.lm import LaplaceLM, State, analytic_state_bytes, kv_cache_bytes
from laplace.pipeline.plots import accuracy_plot, memory_plot
from laplace.pipeline.stage_probes import probe_and_plot
from laplace.runtime import configure_compiler
from laplace.serving.engine import DecodeEngine
from laplace.training import checkpoint as ckpt
from laplace.training.loop import train

from project import TWO_LAYER_RUN, tiny_model_config


def small_model(vocab=32, seed=0, **over):
    torch.manual_seed(seed)
    cfg = tiny_model_config(vocab, **{"n_layers": 2, "init_std": 0.3, **over})
    return LaplaceLM(cfg).eval()  # init_std 0.3: wide logits, no near-ties for argmax


def engine(model, *, max_slots=4, buckets=(16, 32), compile_scope=None, widths=()):
    shapes = dict(
        max_slots=max_slots, widths=list(widths), prefill_buckets=list(buckets), max_prompt_tokens=max(buckets)
    )
    params = dataclasses.replace(
        EngineSection(), **shapes, compile_scope=compile_scope or "block", prefix_cache_bytes=0
    )
    return DecodeEngine(model, params, "padded", compiled=compile_scope is not None)


def poison_dummy(eng):
    for tensor in eng.cache.state.tensors().values():  # recurrent, conv and a hybrid's K/V
        if tensor.is_floating_point():
            tensor[:, eng.cache.pool.dummy] = float("nan")


# --------------------------------------------------------------------------- generator


def test_mqar_layout_hand_checked_smallest_case():
    # one pair in 4 tokens leaves no room for noise: k v k v, the query at position 2
    noise, keys, values = mqar_ranges(16)
    assert (list(noise), keys, values) == ([0, 1], range(2, 8), range(8, 16))
    tokens, targets, mask = mqar_batch(3, 4, 1, 16, rng=0)
    for row, tgt, m in zip(tokens.tolist(), targets.tolist(), mask.tolist()):
        k, v = row[0], row[1]
        assert row == [k, v, k, v] and k in keys and v in values
        assert tgt == [IGNORE, IGNORE, v, IGNORE]
        assert m == [False, False, True, False]


@pytest.mark.parametrize("seq_len,pairs,vocab", [(12, 2, 16), (64, 8, 64), (64, 16, 256), (256, 4, 4096)])
def test_mqar_layout_structure(seq_len, pairs, vocab):
    noise, keys, values = mqar_ranges(vocab)
    tokens, targets, mask = mqar_batch(50, seq_len, pairs, vocab, rng=1)
    assert tokens.shape == targets.shape == mask.shape == (50, seq_len) and mask.dtype == torch.bool
    assert (mask.sum(1) == pairs).all()
    assert (targets[~mask] == IGNORE).all()
    for row, tgt, m in zip(tokens.tolist(), targets.tolist(), mask.tolist()):
        prefix_keys, prefix_values = row[0 : 2 * pairs : 2], row[1 : 2 * pairs : 2]
        assert len(set(prefix_keys)) == pairs and all(k in keys for k in prefix_keys)
        assert all(v in values for v in prefix_values)
        value_of = dict(zip(prefix_keys, prefix_values))
        queries = [t for t in range(seq_len) if m[t]]
        assert all(t >= 2 * pairs for t in queries)
        assert sorted(row[t] for t in queries) == sorted(prefix_keys)  # each key queried once
        for t in queries:  # the target is the key's value, and teacher forcing reads it next
            assert tgt[t] == value_of[row[t]] == row[t + 1]
        answered = set(queries) | {t + 1 for t in queries}
        filler = [row[t] for t in range(2 * pairs, seq_len) if t not in answered]
        assert all(tok in set(noise.tolist()) for tok in filler)


def test_mqar_is_seeded_and_ranges_can_be_chosen():
    a, b = mqar_batch(4, 32, 4, 64, rng=7), mqar_batch(4, 32, 4, 64, rng=7)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    tokens, targets, mask = mqar_batch(20, 32, 4, 64, key_range=(0, 10), value_range=(40, 50))
    assert ((tokens[:, 0:8:2] >= 0) & (tokens[:, 0:8:2] < 10)).all()
    assert ((targets[mask] >= 40) & (targets[mask] < 50)).all()
    assert mqar_chance(64, (0, 10), (40, 50)) == pytest.approx(0.1)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(n=2, seq_len=15, pairs=4, vocab_size=64), "too short for 4 pairs"),
        (dict(n=2, seq_len=64, pairs=8, vocab_size=16), "vocab 16 is too small"),
        (dict(n=2, seq_len=64, pairs=0, vocab_size=64), "at least one"),
        (dict(n=2, seq_len=64, pairs=2, vocab_size=64, key_range=(0, 40), value_range=(30, 64)), "overlap"),
        (dict(n=2, seq_len=64, pairs=2, vocab_size=64, key_range=(0, 32), value_range=(32, 64)), "no id left"),
    ],
)
def test_mqar_rejects_impossible_settings(kwargs, match):
    with pytest.raises(ValueError, match=match) as info:
        mqar_batch(**kwargs)
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------- scoring


def test_an_oracle_scores_100_and_a_random_guesser_scores_chance():
    vocab, n, pairs = 64, 256, 8
    tokens, targets, mask = mqar_batch(n, 64, pairs, vocab, rng=3)
    assert mqar_accuracy_eager(RecallOracle(vocab), tokens, targets, mask) == 1.0
    chance = mqar_chance(vocab)  # 1/32: a uniform guess among the value ids
    acc = mqar_accuracy_eager(RandomGuesser(vocab, mqar_ranges(vocab)[2], seed=0), tokens, targets, mask)
    queries = n * pairs
    sd = math.sqrt(chance * (1 - chance) / queries)  # binomial: 2,048 queries, sd ~0.0038
    assert abs(acc - chance) < 4 * sd
    # the answers score 100%; spoiling one sequence's answers costs exactly its share
    preds = torch.where(mask, targets, -1)
    assert score(preds, targets, mask) == 1.0
    preds[0][mask[0]] = 0
    assert score(preds, targets, mask) == pytest.approx(1 - pairs / queries)


@pytest.mark.parametrize("attn", [None, {"layers": [1], "num_heads": 4}], ids=["gla", "hybrid"])
def test_serving_path_matches_the_eager_path_with_nan_pad_rows(attn):
    m = small_model(vocab=16, attn=attn)
    eng = engine(m, max_slots=4, buckets=(16, 32))
    poison_dummy(eng)
    widths, pads = [], []
    decode = eng.runner.decode_step

    def spy(batch):  # record the widths and pad rows the probe asks for
        slots = batch.ints[1]
        widths.append(len(slots))
        pads.append(int((slots == eng.cache.pool.dummy).sum()))
        return decode(batch)

    eng.runner.decode_step = spy
    tokens, targets, mask = mqar_batch(10, 36, 3, 16, rng=5)  # query prefixes of 6..30 tokens: both buckets
    served = mqar_predictions_serving(eng, tokens, mask)
    eager = mqar_predictions_eager(m, tokens)
    assert set(widths) <= {1, 2, 4} and sum(pads) > 0  # padded ladder widths, pad rows used
    assert eng.cache.pool.free == 4 and not eng.cache.pool.owners  # every slot released
    for tensor in eng.cache.state.tensors().values():  # NaN never left the dummy slot
        assert torch.isfinite(tensor[:, :4].float()).all()
    assert argmax_agreement(served, eager) >= 0.99
    assert score(served, targets, mask) == score(eager, targets, mask)
    assert (served[mask] >= 0).all()  # every query was computed
    assert mqar_accuracy_serving(eng, tokens, targets, mask) == score(served, targets, mask)

    # a query prefix longer than the largest bucket (32) is prefilled in pieces and still agrees
    long_tokens, _, long_mask = mqar_batch(2, 96, 3, 16, rng=7)
    long_mask[:, :70] = False  # first scored query after 70 tokens: pieces of 32 + 32 + 6
    long_mask[:, 70] = True
    served = mqar_predictions_serving(eng, long_tokens, long_mask)
    assert (served[:, :69] == -1).all() and (served[:, 69:71] >= 0).all()
    assert torch.equal(served[:, 69:71], mqar_predictions_eager(m, long_tokens)[:, 69:71])


# The GLA block as TWO_LAYER_RUN's (d_model 64): the 2 graphs compiled here (width 4, bucket 32; a block's
# graph depends on its shapes, not on the vocabulary or the weights) are the ones the end-to-end probes test
# below and the hybrid's GLA layer serve with (this process's Dynamo cache, then Inductor's). One width, 4:
# every step with fewer live rows pads; choosing among ladder widths is the eager test's subject above.
@pytest.mark.slow
def test_compiled_padded_serving_path_matches_eager():
    m = small_model(vocab=16, d_model=64)
    eng = engine(m, max_slots=4, widths=[4], buckets=(32,), compile_scope="block")
    configure_compiler(eng.runner.graphs_needed() + 8)
    eng.runner.warmup()
    poison_dummy(eng)
    pads = []
    decode = eng.runner.decode_step

    def spy(batch):  # the pad rows each step runs
        pads.append(int((batch.ints[1] == eng.cache.pool.dummy).sum()))
        return decode(batch)

    eng.runner.decode_step = spy
    tokens, targets, mask = mqar_batch(12, 32, 3, 16, rng=2)
    with torch.compiler.set_stance("fail_on_recompile"):
        served = mqar_predictions_serving(eng, tokens, mask)
    eager = mqar_predictions_eager(m, tokens)  # force_eager inside: no new graphs
    assert sum(pads) > 0  # rows on the NaN dummy slot ran beside real ones
    assert torch.isfinite(eng.cache.state.recurrent[:, :4]).all()
    assert argmax_agreement(served, eager) >= 0.99
    assert score(served, targets, mask) == score(eager, targets, mask)


# --------------------------------------------------------------------------- long prompts, passkey


def test_chunked_prefill_equals_one_prefill_of_the_whole_prompt():
    m = small_model(vocab=32)
    eng = engine(m, buckets=(16, 32))
    prompt = torch.randint(0, 32, (1, 77), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        chunked = prefill_long(eng, prompt[0].tolist(), slot=1)
        state = m.allocate_state(1)
        whole = m.prefill(prompt, state)
    torch.testing.assert_close(chunked, whole, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(eng.cache.state.recurrent[:, 1], state.recurrent[:, 0], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="empty"):
        prefill_long(eng, [], slot=0)


class CharTokenizer:
    """Stand-in for a tokenizers.Tokenizer: one id per character."""

    def encode(self, text, add_special_tokens=True):  # no specials: nothing to add
        return SimpleNamespace(ids=[ord(c) % 128 for c in text])

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_passkey_prompt_layout_and_scoring():
    tok = CharTokenizer()
    haystack = np.array(tok.encode("lorem ipsum dolor sit amet " * 20).ids)
    rng = np.random.default_rng(0)
    for ctx, depth in ((120, 0.0), (300, 0.5), (900, 0.9)):  # 900 > the haystack: repeated
        prompt = tok.decode(passkey_prompt(tok, haystack, ctx, depth, 48213, rng))
        assert len(prompt) == ctx and prompt.endswith("What is the pass key? The pass key is")
        at = prompt.index("The pass key is 48213")
        filler = (
            ctx
            - len(" The pass key is 48213. Remember it. 48213 is the pass key.")
            - len(" What is the pass key? The pass key is")
        )
        assert abs(at - 1 - depth * filler) <= 1
    with pytest.raises(ValueError, match="shorter than the needle"):
        passkey_prompt(tok, haystack, 20, 0.5, 48213, rng)
    assert passkey_found(" 48213. Remember", 48213) and passkey_found(" 48 213", 48213)
    assert not passkey_found(" 4821", 48213)


def test_passkey_probe_reports_every_context_and_depth():
    m = small_model(vocab=128)
    eng = engine(m, buckets=(16, 32))
    poison_dummy(eng)
    tok = CharTokenizer()
    haystack = np.array(tok.encode("the quick brown fox jumps over the lazy dog. " * 10).ids)
    out = passkey_probe(eng, tok, haystack, [110, 140], [0.25, 0.75], samples=2, seed=0, new_tokens=4, progress=False)
    assert set(out["accuracy"]) == {110, 140} and set(out["accuracy_by_depth"]) == {0.25, 0.75}
    assert out["accuracy_grid"].keys() == {110, 140} and out["accuracy_grid"][110].keys() == {0.25, 0.75}
    assert len(out["table"]) == 8 and all(r["prompt_tokens"] in (110, 140) for r in out["table"])
    assert all(0.0 <= a <= 1.0 for a in out["accuracy"].values())
    assert not eng.cache.pool.owners


# --------------------------------------------------------------------------- memory


@pytest.mark.parametrize(
    "over,dtype",
    [
        (dict(), torch.float32),
        (dict(use_short_conv=False), torch.float32),
        (dict(n_heads=4, d_model=64, expand_k=1.0), torch.float32),
        (dict(dtype="bfloat16"), torch.bfloat16),
        (dict(dtype="float64"), torch.float64),
    ],
)
def test_measured_state_bytes_equal_the_formula(over, dtype):
    m = small_model(vocab=32, **over).to(dtype)
    eng = engine(m)
    report = memory_report(m, eng, contexts=[], kv_contexts=[1024], progress=False)
    assert report["state_bytes_measured"] == report["state_bytes_analytic"] == analytic_state_bytes(m.cfg, dtype)
    assert report["state_bytes_measured"] == State.allocate(m.cfg, 1, dtype=dtype).nbytes


def test_kv_cache_formula_and_the_3b_figures():
    cfg = preset_model_config("tiny", vocab_size=97)
    assert kv_cache_bytes(cfg, 8192) == 2 * cfg.n_layers * 8192 * cfg.d_model * 2  # K and V, bf16
    m = small_model(vocab=32)
    report = memory_report(m, engine(m), contexts=[], kv_contexts=[2048, 8192], progress=False)
    assert report["kv_bytes"] == {2048: kv_cache_bytes(m.cfg, 2048), 8192: kv_cache_bytes(m.cfg, 8192)}
    assert report["kv_bytes"][8192] == 4 * report["kv_bytes"][2048] == report["kv_bytes_8192"]
    # the article: 29.5 MB of state per sequence, ~82x smaller than the KV cache at 8,192 tokens
    assert report["laplace_3b_state_bytes"] == report["laplace_3b_state_bytes_analytic"]
    assert report["laplace_3b_state_bytes"] == pytest.approx(29.5e6, rel=0.02)
    assert report["laplace_3b_kv_bytes_8192"] == 2 * 24 * 8192 * 3072 * 2
    assert 80 < report["laplace_3b_state_vs_kv_8192"] < 85
    assert 2.9e9 < report["laplace_3b_params"] < 3.2e9


def test_decode_rss_has_one_entry_per_context_and_plots_are_written(tmp_path):
    m = small_model(vocab=32)
    eng = engine(m, buckets=(16, 32))
    report = memory_report(
        m,
        eng,
        contexts=[64, 300, 1000],
        kv_contexts=[2048, 8192],
        decode_steps=4,
        text=np.arange(50) % 32,
        progress=False,
    )
    assert list(report["decode_rss_bytes"]) == [64, 300, 1000]
    assert all(v > 0 for v in report["decode_rss_bytes"].values())
    assert report["decode_rss_flat_ratio"] >= 1.0
    assert not eng.cache.pool.owners
    memory_plot(report, tmp_path / "memory.png")
    accuracy_plot(
        {
            "accuracy": {64: {4: 0.9, 8: 0.5}, 256: {4: 0.8, 8: 0.4, 16: 0.1}},
            "chance": 1 / 32,
            "state_floats": 2048,
            "train_pairs": 8,
            "train_seq_len": 64,
        },
        tmp_path / "mqar.png",
    )
    assert (tmp_path / "memory.png").stat().st_size > 10_000 and (tmp_path / "mqar.png").stat().st_size > 10_000


def test_decode_rss_without_text_uses_a_fixed_token():
    m = small_model(vocab=32)
    assert list(decode_rss(engine(m), [20, 40], decode_steps=2, progress=False)) == [20, 40]


# --------------------------------------------------------------------------- MQAR training


def test_a_short_mqar_training_run_returns_the_grid():
    probes = ProbesSection(
        mqar_train_steps=4,
        mqar_train_d_model=32,
        mqar_train_heads=2,
        mqar_train_layers=1,
        mqar_train_vocab=64,
        mqar_train_seq_len=32,
        mqar_train_pairs=4,
        mqar_contexts=[16, 32],
        mqar_pairs=[2, 4, 16],
        mqar_samples=4,
    )
    result = train_mqar(probes, seed=0, progress=False)
    assert result["accuracy"].keys() == {16, 32}
    assert result["accuracy"][16].keys() == {2, 4} and result["accuracy"][32].keys() == {2, 4}  # 16 pairs never fit
    assert all(0.0 <= a <= 1.0 for row in result["accuracy"].values() for a in row.values())
    assert result["state_floats"] == 1 * 2 * 8 * 16  # layers * heads * (K/H) * (V/H)
    assert result["state_bytes"] == analytic_state_bytes(
        preset_model_config("tiny", vocab_size=64, d_model=32, n_layers=1, n_heads=2, chunk_size=32, sub_chunk_size=16)
    )
    assert math.isfinite(result["final_loss"]) and result["train_seconds"] > 0
    assert result["chance"] == mqar_chance(64)
    with pytest.raises(ValueError, match="holds no MQAR pair"):
        train_mqar(ProbesSection(mqar_train_seq_len=3), seed=0, progress=False)


@pytest.mark.slow
def test_the_default_recipe_check_runs_and_fails_a_recipe_that_did_not_learn():
    """bench/mqar_probe.py checks that params.yaml's MQAR recipe learns (about 4 minutes, so out of
    the suite; bench/RESULTS.md has its run). Here: the same script at 5 steps, far before the jump,
    scored on fewer lengths and sequences, which must say so and exit 1 with the failed checks named."""
    from project import run_bench

    result = run_bench("mqar_probe.py", "--steps", "5", "--contexts", "64", "256", "--samples", "4", exit_status=1)
    assert result["steps"] == 5 and not result["learned"]
    assert any(line.startswith("easiest cell (64 tokens, 4 pairs) at ") for line in result["failures"]), result
    assert any(line.startswith("final loss ") for line in result["failures"]), result
    assert set(result["accuracy"]) == {"64", "256"} and set(result["recall_verdict"]) == {"64", "256"}


def tiny_probe_config(**sections) -> dict:
    """A 2-layer model a few steps trained, and probes sized to run in seconds."""
    return {
        **copy.deepcopy(TWO_LAYER_RUN),  # the hybrid test adds to its model section
        "train": {
            "steps": 2,
            "batch_size": 2,
            "seq_len": 32,
            "eval_every": 2,
            "eval_batches": 1,
            "checkpoint_every": 2,
            "warmup_steps": 1,
        },
        # the compiled serving test's shapes (its graphs); longer prompts are prefilled in pieces
        "engine": {"max_slots": 4, "widths": [4], "prefill_buckets": [32], "max_prompt_tokens": 64},
        "probes": {
            "mqar_contexts": [32, 128],
            "mqar_pairs": [2, 4],
            "mqar_samples": 6,
            "passkey_contexts": [64, 200],
            "passkey_depths": [0.5],
            "passkey_samples": 1,
            "recall_contexts": [320, 640],  # the training length is 32: both beyond it
            "recall_samples": 1,
            "memory_contexts": [128, 1024],
            "kv_contexts": [2048, 8192],
            "mqar_train_steps": 3,
            "mqar_train_d_model": 32,
            "mqar_train_layers": 1,
            "mqar_train_vocab": 64,
            "mqar_train_seq_len": 32,
            "mqar_train_pairs": 4,
        },
    } | sections


@pytest.fixture(scope="module")
def probe_data(tmp_path_factory):
    """tiny_probe_config's tokenized corpus, built once for the GLA and hybrid exports (read only)."""
    cfg = config_from_dict(tiny_probe_config())
    data = tmp_path_factory.mktemp("probe-data") / "data"
    tokenize_corpus(cfg.data, cfg.tokenizer, data, cfg.seed)
    return data


@pytest.mark.slow
def test_run_probes_end_to_end_on_a_tiny_export(tmp_path, probe_data):
    cfg = config_from_dict(tiny_probe_config())
    data = probe_data
    trained = train(cfg, data, tmp_path / "run", progress=False)
    export_model(ckpt.load_checkpoint(trained.checkpoint), data / "tokenizer.json", tmp_path / "export")

    metrics = probe_and_plot(cfg, tmp_path / "export", data, tmp_path / "plots")  # run_probes + the plots
    json.dumps(metrics)  # JSON-ready: string keys all the way down
    assert metrics["passed"] and metrics["mqar_paths_agree"] and metrics["state_bytes_match"]
    assert metrics["mqar_serving_vs_eager_agreement"] >= 0.99
    assert set(metrics["mqar_accuracy"]) == {"32", "128"}  # 128 > the largest bucket: eager only, noted
    assert any("context 128" in note for note in metrics["notes"])
    assert set(metrics["mqar_trained_accuracy"]) == {"32", "128"}
    assert set(metrics["mqar_trained_accuracy"]["32"]) == {"2", "4"}
    assert set(metrics["passkey_accuracy"]) == {"64", "200"}
    # the recall suite: every task at its lengths, and a plain verdict per length (a 2-step model recalls nothing)
    assert set(metrics["recall"]) == {"niah_single", "niah_multikey", "niah_multivalue", "passkey", "mqar"}
    assert set(metrics["recall"]["niah_multikey"]) == {"320", "640"}
    assert set(metrics["recall_verdict"]) == {"32", "64", "128", "200", "320", "640"}
    assert all(v == "recall: none above chance" for v in metrics["recall_verdict"].values()), metrics["recall"]
    assert metrics["recall_summary"] == "recall: none above chance at any length"
    assert set(metrics["recall_trained_mqar"]) == {"32", "128"}  # the probe-trained GLA, through an engine
    assert set(metrics["decode_rss_bytes"]) == {"128", "1024"} and metrics["decode_rss_flat_ratio"] >= 1.0
    assert set(metrics["kv_bytes"]) == {"2048", "8192"}
    for key in (
        "state_bytes_measured",
        "state_bytes_analytic",
        "kv_bytes_8192",
        "laplace_3b_state_bytes",
        "laplace_3b_kv_bytes_8192",
        "laplace_3b_state_vs_kv_8192",
        "mqar_trained_state_bytes",
    ):
        assert metrics[key] > 0, key
    for name in ("probes_mqar.png", "probes_memory.png", "probes_mqar.json", "probes_passkey.json"):
        assert (tmp_path / "plots" / name).stat().st_size > 0, name


@pytest.mark.slow
def test_numerics_and_probes_run_unchanged_on_a_hybrid_export(tmp_path, probe_data):
    """A GLA layer then an attention layer, trained, exported, then the numerics stage's checks
    (compiled vs eager vs fp64, every gate) and the probes, as the pipeline runs them on GLA."""
    from laplace.evals.numerics import run_numerics

    # the GLA block's compiled entries from this module's earlier tests count toward the recompile limit,
    # which this model's own graph count sets (a fresh-clone run hit it at 22)
    torch._dynamo.reset()
    hybrid = tiny_probe_config()
    hybrid["model"] |= {"attn": {"layers": [1], "num_heads": 2}}
    hybrid["engine"] |= {"max_context": 2048}  # every probed length and its answer fit
    # one width and one bucket: the engine's graphs are 2 per kind of block (each ~15 CPU-s cold), the GLA
    # layer's from Inductor's cache (the compiled serving test's); the ladder is the GLA tests' subject
    hybrid["numerics"] = {"batch_size": 2, "seq_len": 32, "prompt_tokens": 16, "greedy_prompts": 2}
    hybrid["numerics"] |= {"greedy_tokens": 8}
    cfg = config_from_dict(hybrid)
    data = probe_data  # the model and engine sections differ, the data and tokenizer sections do not
    trained = train(cfg, data, tmp_path / "run", progress=False)
    export_model(ckpt.load_checkpoint(trained.checkpoint), data / "tokenizer.json", tmp_path / "export")

    numerics = run_numerics(cfg, tmp_path / "export", data)  # both precisions: the suite's one bf16 check
    assert numerics["passed"], numerics["gate_table"]
    assert numerics["fp32"]["prefill"]["rel_rms_compiled_vs_fp64"] < 1e-5  # the fp32 gate's own bound
    assert numerics["greedy_agreement_fp32"] == 1.0
    bf16_gates = [name for name in numerics["gates"] if name.startswith("bf16 ")]
    assert "bf16 train-step gradient error compiled / eager" in bf16_gates and len(bf16_gates) >= 5, bf16_gates
    assert numerics["rel_rms_bf16_compiled_vs_fp64"] <= 1.5 * numerics["rel_rms_bf16_eager_vs_fp64"]

    metrics = probe_and_plot(cfg, tmp_path / "export", data, tmp_path / "plots")
    assert metrics["passed"] and metrics["mqar_paths_agree"], metrics["notes"]
    # the engine's own allocation: recurrent state of the GLA layer, K/V of the attention layer to 2,048
    assert metrics["state_bytes_match"] and metrics["kv_bytes_match"]
    head_dim = 64 // 2
    assert metrics["kv_bytes_measured"] == 2 * 2048 * 2 * head_dim * 4  # K and V, 2 heads, fp32
    assert "contexts_over_max_context" not in metrics, metrics["notes"]
    assert set(metrics["recall_verdict"]) == {"32", "64", "128", "200", "320", "640"}


def test_recall_lengths_follow_the_training_length_above_the_configured_floor():
    from laplace.evals.probes import recall_lengths

    def lengths(seq_len, contexts):
        raw = {"train": {"seq_len": seq_len}, "probes": {"recall_contexts": contexts}}
        return recall_lengths(config_from_dict(raw))

    assert lengths(256, [256, 1024, 4096]) == [256, 1024, 4096]  # the default: already there
    assert lengths(2048, [256, 1024, 4096]) == [256, 1024, 2048, 4096, 8192]  # a fine-tune at 2,048 tokens
    assert lengths(32, [320, 640]) == [320, 640]  # below the floor: not added
    assert lengths(512, []) == [512, 2048]
