"""The numerics checks: figures are right, a broken compiled path fails the gates, the healthy one
passes, and eager mode is bitwise reproducible across processes."""

import json
import subprocess
import sys

import pytest
import torch

from laplace.config import config_from_dict
from laplace.evals.numerics import check_dtype, compare_logits, dtype_gates, gate_table, reference, rel_rms


def test_compare_logits_figures():
    ref = torch.tensor([[3.0, 1.0, 0.0], [1.0, 0.9, 0.0], [0.0, 0.0, 5.0]], dtype=torch.float64)
    eager = ref.clone()
    compiled = ref.clone()
    compiled[1] = torch.tensor([0.9, 1.0, 0.0])  # flips a near-tie (margin 0.1)
    r = compare_logits(eager, compiled, ref, margin=0.5)
    assert r["positions"] == 3 and r["excluded_near_ties"] == 1
    assert r["top1_compiled_vs_eager"] == pytest.approx(2 / 3)
    assert r["top1_compiled_vs_eager_clear"] == 1.0  # the flip sits on an excluded near-tie
    assert r["max_abs_logit_diff"] == pytest.approx(0.1)
    assert r["rel_rms_eager_vs_fp64"] == 0.0
    assert r["rel_rms_compiled_vs_fp64"] == pytest.approx(rel_rms(compiled, ref))
    assert r["cosine_min_eager_vs_fp64"] == pytest.approx(1.0)


def test_numerics_train_step_false_leaves_out_the_training_steps_gates_and_keeps_every_other():
    """`numerics.train_step: false` (a pilot that only serves): the report has no training step, so no
    gate is made of one; the prefill and decode gates stay, at both precisions."""
    graph = {"rel_rms_compiled_vs_fp64": 1e-7, "rel_rms_eager_vs_fp64": 1e-7}
    graph |= {"top1_compiled_vs_eager_clear": 1.0, "top1_compiled_vs_fp64_clear": 1.0}
    trained = {"grad_rel_rms_compiled_vs_fp64": 2e-3, "grad_rel_rms_eager_vs_fp64": 1e-3}
    report = {"prefill": graph, "decode": {"1": graph, "2": graph}}  # check_dtype's, without a training step
    cfg = config_from_dict({"numerics": {"train_step": False}})
    for name in ("fp32", "bf16"):
        full = dtype_gates(cfg, name, report | {"train_step": trained})
        train_gates = {k for k in full if "train-step" in k}
        assert len(train_gates) == 1 and set(dtype_gates(cfg, name, report)) == set(full) - train_gates
    assert config_from_dict({}).numerics.train_step is True  # the default checks it


def held_out(data_dir, rows=2, length=40):
    from laplace.data.shards import open_split

    val = open_split(data_dir, "val")
    return torch.as_tensor(val[: rows * length].astype("int64")).view(rows, length)


def fingerprint_in_subprocess(export_dir, data_dir) -> dict:
    code = (
        "import json, sys, torch\n"
        "from pathlib import Path\n"
        "from laplace.data.shards import open_split\n"
        "from laplace.evals.numerics import eager_fingerprint\n"
        "val = open_split(Path(sys.argv[2]), 'val')\n"
        "tokens = torch.as_tensor(val[:128].astype('int64')).view(2, 64)\n"
        "f = eager_fingerprint(Path(sys.argv[1]), tokens, 12, seed=0)\n"
        "print(json.dumps({k: f[k] for k in ('logits_sha256', 'tokens_sha256')}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(export_dir), str(data_dir)], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_eager_mode_is_bitwise_reproducible_across_processes(tiny_artifacts):
    data_dir, export_dir = tiny_artifacts
    first = fingerprint_in_subprocess(export_dir, data_dir)
    second = fingerprint_in_subprocess(export_dir, data_dir)
    assert first == second


# Cold: 5 Inductor graphs of the GDN model (~90 CPU-s on 2 cores); the broken pass reuses them (~1 s).
# The GLA block's compiled path is gated in-process by the hybrid export's run_numerics (GLA + attention,
# fp32 and bf16: tests/test_probes.py) and by every pipeline's numerics stage.
@pytest.mark.slow
def test_a_broken_compiled_path_fails_the_gates_and_the_healthy_one_passes(tiny_artifacts, tmp_path):
    """The gates on a Gated DeltaNet export (docs/model.md: checked by hand before): a 1-layer GDN
    model (GVA, random weights with wide logits) through check_dtype at fp32, eager and compiled
    (Inductor: the engine's decode and prefill graphs, the train step's forward and backward),
    against its fp64 reference; every gate passes. Then the same check with one weight of the
    compiled side 1% off (the same graphs, other weights): the prefill and train-step gates fail."""
    from laplace.model.export import load_export
    from laplace.model.lm import LaplaceLM
    from laplace.runtime import configure_compiler

    from project import tiny_model_config, write_model_export

    data_dir, trained = tiny_artifacts
    vocab = load_export(trained)[0].cfg.vocab_size
    gdn = {"layers": [0], "num_heads": 1, "num_v_heads": 2, "head_dim": 16, "expand_v": 1.5}
    torch.manual_seed(0)
    export_dir = write_model_export(
        LaplaceLM(tiny_model_config(vocab, init_std=0.3, gdn=gdn)), trained / "tokenizer.json", tmp_path / "gdn"
    )
    # one slot (decode width 1), one chunk of 16 tokens per prefill: each graph is an Inductor compile
    engine = {"max_slots": 1, "prefill_buckets": [16], "max_prompt_tokens": 16}
    numerics = {"batch_size": 2, "seq_len": 16, "prompt_tokens": 8, "greedy_prompts": 2, "greedy_tokens": 8}
    cfg = config_from_dict({"engine": engine, "numerics": numerics})
    configure_compiler(40)
    tokens = held_out(data_dir)
    ref_model, _, _ = load_export(export_dir, dtype=torch.float64)
    assert ref_model.blocks[0].is_delta
    ref = reference(cfg, ref_model, tokens)

    healthy = check_dtype(cfg, export_dir, torch.float32, tokens, ref)
    g = dtype_gates(cfg, "fp32", healthy)
    assert all(ok for ok, _, _ in g.values()), gate_table(g)
    assert list(healthy["decode"]) == ["1"] and healthy["prefill"]["rel_rms_compiled_vs_fp64"] < 1e-5
    assert healthy["greedy"]["mean_agreement"] == 1.0

    def perturb(model):  # a weight used only by the compiled model is 1% off
        with torch.no_grad():
            model.blocks[0].mlp.up_proj.weight.mul_(1.01)

    broken = check_dtype(cfg, export_dir, torch.float32, tokens, ref, corrupt_compiled=perturb)
    g = dtype_gates(cfg, "fp32", broken)
    failed = [k for k, (ok, _, _) in g.items() if not ok]
    assert "fp32 prefill compiled vs fp64 rel RMS" in failed
    assert "fp32 train-step gradients compiled vs fp64 rel RMS" in failed
    assert "FAIL" in gate_table(g)
