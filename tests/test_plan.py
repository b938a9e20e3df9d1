"""The dry-run planner's memory side: activations measured with fake tensors against a real
backward, every rank's figures, and the 3B configuration of the article on 24 GiB."""

from __future__ import annotations

import pytest
import torch

from laplace.errors import ConfigError
from laplace.model.config import preset_model_config
from laplace.model.lm import LaplaceLM
from laplace.training.activations import activation_bytes, measure_live_peak
from laplace.training.plan import GIB, as_text, parse_bytes, plan


@pytest.mark.parametrize(
    "overrides, micro_batch, seq_len",
    [
        ({}, 2, 128),
        ({"n_layers": 6, "tie_embeddings": True}, 1, 256),
        ({"attn": {"layers": [1, 3], "num_heads": 4, "num_kv_heads": 2}}, 2, 128),  # a hybrid
        ({"attn": {"layers": [0, 1, 2, 3], "num_heads": 4, "window_size": 64}}, 1, 256),  # softmax, windowed
    ],
)
def test_plan_activation_bytes_are_within_15_percent_of_the_peak_measured_during_a_real_backward(
    overrides, micro_batch, seq_len
):
    """The plan's activations (one block and the outer part measured on fake tensors, the peak
    composed for L blocks) against the peak of live saved-tensor bytes during a real forward,
    loss and backward of the whole model on the CPU (saved-tensor hooks whose handles autograd
    frees as it goes). No GPU here: torch.cuda.max_memory_allocated is not checked."""
    cfg = preset_model_config("tiny", vocab_size=2048, **overrides)
    planned = plan(cfg, 2, "fp32", seq_len=seq_len, micro_batch=micro_batch)
    per_sequence = planned["activations"]["peak_bytes"]["none"]
    torch.manual_seed(0)
    model = LaplaceLM(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len + 1))
    measured = measure_live_peak(model, tokens[:, :-1], tokens[:, 1:])
    assert abs(micro_batch * per_sequence - measured) <= 0.15 * measured, (micro_batch * per_sequence, measured)
    # the mode's figure adds the logits' gradient, allocated by the loss's backward
    assert planned["modes"]["none"]["activation_bytes"] == micro_batch * (
        per_sequence + planned["activations"]["logits_gradient_bytes"]
    )


def test_activations_scale_with_the_micro_batch_and_checkpointing_keeps_less():
    cfg = preset_model_config("tiny", vocab_size=2048)
    one, three = (activation_bytes(cfg, b, 128, torch.bfloat16) for b in (1, 3))
    for mode, bytes_one in one["peak_bytes"].items():  # linear, but for a few scalars of the loss
        assert three["peak_bytes"][mode] == pytest.approx(3 * bytes_one, rel=1e-3), mode
    peak = one["peak_bytes"]
    assert peak["full"] < peak["selective"] < peak["none"]
    kept = one["kept_per_block_bytes"]
    assert kept["full"] == 128 * cfg.d_model * 2  # a block's bf16 input, nothing else
    assert kept["full"] < kept["selective"] < kept["none"]


def test_the_article_3b_on_64_ranks_at_2048_tokens_fits_24_gib_with_checkpointing_only():
    """The issue's figures: about 458 KB per token per layer saved without checkpointing, so one
    2,048-token sequence does not fit 24 GiB; selective checkpointing fits, and full fits more."""
    p = plan(preset_model_config("laplace-3b"), 64, "bf16", 24.0, seq_len=2048, micro_batch=1)
    per_token_layer = p["activations"]["block_saved_bytes"] / 2048
    assert 400e3 < per_token_layer < 520e3, per_token_layer
    modes = p["modes"]
    assert not modes["none"]["fits"] and modes["selective"]["fits"] and modes["full"]["fits"]
    assert modes["full"]["max_micro_batch"] > modes["selective"]["max_micro_batch"] >= 1
    assert p["needs_activation_checkpoint"] == "selective" and not p["fits"]  # params' default is none
    # every rank's figures, not rank 0's: the max is what must fit, the mean is below it
    assert p["per_rank_total_max_bytes"] >= p["per_rank_total_mean_bytes"] > 0
    assert p["per_rank_max_bytes"]["parameters"] == p["per_rank_bytes"]["parameters"]  # rank 0: ceil rows
    # FSDP2 units of their own: the embedding and head are no longer gathered through the step
    assert p["per_rank_bytes"]["fsdp_transient_peak"] < 2 * GIB
    text = as_text(p, "laplace-3b")
    assert "needs train.activation_checkpoint: selective" in text and "max over the 64 ranks" in text
    # accumulating micro-batches holds every gradient unsharded in fp32 until the last one
    accumulating = plan(preset_model_config("laplace-3b"), 64, "bf16", 24.0, seq_len=2048, grad_accum_steps=4)
    assert accumulating["per_rank_bytes"]["unsharded_gradient_accumulators"] == 4 * p["params"]


def test_device_memory_sizes_parse_and_bad_ones_name_the_flag():
    assert parse_bytes("24GiB") == 24 * GIB and parse_bytes("80GB") == 80 * 10**9 and parse_bytes("512") == 512
    with pytest.raises(ConfigError, match="--device-memory: expected a size"):
        parse_bytes("24 parsecs", "--device-memory")


def test_checkpointed_blocks_leave_autograd_only_their_inputs():
    """Checkpointing really engages: under full and selective, what autograd itself keeps through
    a real forward and backward (the saved-tensor hook sees nothing the checkpoint keeps or
    recomputes inside a block) is each block's input plus the embedding, head and loss's
    tensors, as the plan composes it, a tenth of no checkpointing's. (The selective policy's
    kept projections live in its own cache: the plan counts them, the comparison of the modes'
    memory is bench/train_step.py --recompute's, under torch's MemTracker.)"""
    from laplace.training.activation_checkpoint import apply_activation_checkpointing

    cfg = preset_model_config("tiny", vocab_size=2048, n_layers=4)
    planned = activation_bytes(cfg, 2, 128, torch.float32)
    inputs_only = cfg.n_layers * planned["block_input_bytes"] + planned["outer_saved_bytes"]
    tokens = torch.randint(0, cfg.vocab_size, (2, 129), generator=torch.Generator().manual_seed(0))
    kept = {}
    for mode in ("none", "full", "selective"):
        torch.manual_seed(0)
        model = LaplaceLM(cfg)
        apply_activation_checkpointing(model, mode)
        kept[mode] = measure_live_peak(model, tokens[:, :-1], tokens[:, 1:])
    for mode in ("full", "selective"):
        assert kept[mode] == pytest.approx(inputs_only, rel=0.01), (mode, kept, inputs_only)
        assert kept[mode] < 0.1 * kept["none"]


def test_a_hybrids_plan_counts_its_attention_layers_and_their_growth_with_the_length():
    gla = preset_model_config("tiny", vocab_size=2048)
    hybrid = preset_model_config("tiny-hybrid", vocab_size=2048)
    p_gla, p_hybrid = (plan(c, 2, "fp32", seq_len=128) for c in (gla, hybrid))
    # parameters: the attention layer's q/k/v/o replace a GLA layer's projections, routed to Muon
    assert p_hybrid["params"] == meta_params(hybrid) and p_hybrid["params"] != p_gla["params"]
    growth = p_hybrid["activation_growth"]
    assert list(growth) == [128, 256, 512]
    assert (
        growth[128]["attention_block_saved_bytes"] > 0
        and p_gla["activation_growth"][128]["attention_block_saved_bytes"] == 0
    )
    # at least linear in the length
    assert growth[512]["activation_bytes"] >= 4 * growth[128]["activation_bytes"] * 0.99
    assert "activations of one sequence as it grows" in as_text(p_hybrid, "tiny-hybrid")


def meta_params(cfg) -> int:
    with torch.device("meta"):
        return LaplaceLM(cfg).num_parameters()


def test_the_readme_hybrid_plan_command_runs_and_shows_the_attention_layers_growth():
    import shlex
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[1]
    (line,) = [
        x for x in (root / "README.md").read_text().splitlines() if x.startswith("laplace plan --preset tiny-hybrid")
    ]
    args = shlex.split(line.split("  #")[0])
    assert args[:4] == ["laplace", "plan", "--preset", "tiny-hybrid"]
    out = subprocess.run(
        [sys.executable, "-m", "laplace.pipeline.cli", *args[1:]], cwd=root, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "activations of one sequence as it grows" in out.stdout
    assert all(f"{n:>8,} tokens" in out.stdout for n in (1024, 2048, 4096)), out.stdout
