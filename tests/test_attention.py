"""Softmax attention layers and hybrid models: the layer against a naive reference written here
(fp64, GQA, sliding window, qkv bias), the cache forms against the full forward, the AttentionSpec
knob's defaults and refusals against fla's own parse_attention_config, and the byte accounting."""

from __future__ import annotations

import math

import pytest
import torch

from laplace.config import ConfigError
from laplace.model.attention import SoftmaxAttention
from laplace.model.config import (
    PRESETS,
    AttentionSpecError,
    ModelConfig,
    parse_attention_config,
    preset_model_config,
    validate_model_config,
)
from laplace.model.lm import LaplaceLM, State, analytic_kv_bytes, analytic_state_bytes, sequence_bytes

D, T = 32, 23


def naive_rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE as fla's RotaryEmbedding applies it: inverse frequencies 1/theta^(2i/d) and positions
    in fp32, cos/sin of their product cast to x's dtype, rotate_half over the two halves."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.outer(torch.arange(x.shape[1], dtype=torch.float32), inv_freq)
    cos = torch.cat([freqs.cos(), freqs.cos()], -1).to(x.dtype)[None, :, None]
    sin = torch.cat([freqs.sin(), freqs.sin()], -1).to(x.dtype)[None, :, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def naive_attention(layer: SoftmaxAttention, x: torch.Tensor, window: int | None) -> torch.Tensor:
    """Every head by hand: an explicit softmax over scores masked to the causal (windowed) past."""
    B, n = x.shape[:2]
    H, Hkv, d = layer.n_heads, layer.n_kv_heads, layer.head_dim
    q = naive_rope(layer.q_proj(x).view(B, n, H, d), layer.rope_theta)
    k = naive_rope(layer.k_proj(x).view(B, n, Hkv, d), layer.rope_theta)
    v = layer.v_proj(x).view(B, n, Hkv, d)
    out = torch.zeros(B, n, H, d, dtype=x.dtype)
    for h in range(H):
        g = h // (H // Hkv)  # flash-attn's GQA rule
        scores = torch.einsum("bid,bjd->bij", q[:, :, h], k[:, :, g]) / math.sqrt(d)
        i, j = torch.arange(n)[:, None], torch.arange(n)[None]
        allowed = (j <= i) & ((j > i - window) if window else True)
        scores = scores.masked_fill(~allowed, float("-inf"))
        p = scores.exp() / scores.exp().sum(-1, keepdim=True)
        out[:, :, h] = torch.einsum("bij,bjd->bid", p, v[:, :, g])
    return layer.o_proj(out.reshape(B, n, H * d))


SPECS = [
    {"layers": [0], "num_heads": 4},
    {"layers": [0], "num_heads": 4, "num_kv_heads": 2, "qkv_bias": True},  # GQA
    {"layers": [0], "num_heads": 4, "num_kv_heads": 1, "window_size": 5, "rope_theta": 500.0},  # MQA + window
]


def _layer(spec: dict) -> SoftmaxAttention:
    cfg = validate_model_config(ModelConfig(vocab_size=64, d_model=D, n_layers=1, n_heads=2, attn=spec))
    torch.manual_seed(0)
    layer = SoftmaxAttention(cfg, cfg.attention_spec(0)).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    return layer


@pytest.mark.parametrize("spec", SPECS, ids=["mha", "gqa-bias", "mqa-window"])
def test_attention_matches_the_naive_reference_in_fp64(spec):
    layer = _layer(spec)
    x = torch.randn(2, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref = naive_attention(layer, x, spec.get("window_size"))
    with torch.no_grad():
        assert (layer(x) - ref).abs().max() < 1e-12
        # the cache forms: a padded prefill of two pieces, then one token at a time, equal it too
        keys = torch.zeros(2, 40, layer.n_kv_heads, layer.head_dim, dtype=torch.float64)
        values = torch.zeros_like(keys)
        rows = torch.tensor([0, 1])
        first = layer.prefill(x[:, :12], keys, values, rows, torch.tensor([0, 0]), None)
        lengths = torch.tensor([5, 3])  # right-padded to 8: row 1's last 5 tokens are padding
        second = layer.prefill(x[:, 12:20], keys, values, rows, torch.tensor([12, 12]), lengths)
        assert (first - ref[:, :12]).abs().max() < 1e-12
        assert (second[0, :5] - ref[0, 12:17]).abs().max() < 1e-12
        assert (second[1, :3] - ref[1, 12:15]).abs().max() < 1e-12
        assert keys[1, 15:].abs().max() == 0  # padding wrote nothing
        steps = [layer.step(x[:1, t : t + 1], keys, values, torch.tensor([0]), torch.tensor([t])) for t in range(17, T)]
        assert (torch.cat(steps, 1) - ref[:1, 17:]).abs().max() < 1e-12


def _model(attn, dtype="float64", n_layers=4, **over) -> LaplaceLM:
    cfg = validate_model_config(
        ModelConfig(
            vocab_size=97,
            d_model=D,
            n_layers=n_layers,
            n_heads=2,
            chunk_size=16,
            sub_chunk_size=8,
            attn=attn,
            dtype=dtype,
            **over,
        )
    )
    torch.manual_seed(0)
    model = LaplaceLM(cfg).to(getattr(torch, dtype)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


HYBRID = {"layers": [1, 3], "num_heads": 4, "num_kv_heads": 2, "window_size": 9}


@pytest.mark.parametrize(
    "attn",
    [
        HYBRID,
        {"layers": [0, 1, 2, 3], "num_heads": 2},
        # two specs of different K/V widths share one cache tensor (the narrower one a view of part of it)
        [{"layers": [1], "num_heads": 4, "num_kv_heads": 1}, {"layers": [3], "num_heads": 2, "rope_theta": 100.0}],
    ],
    ids=["hybrid", "softmax", "two-specs"],
)
def test_prefill_in_pieces_and_decode_equal_the_full_forward(attn):
    model = _model(attn)
    tokens = torch.randint(0, 97, (3, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(tokens)
        state = model.allocate_state(4, max_context=48)
        slots = torch.tensor([2, 0, 3])  # rows of a larger pool, out of order
        lengths = torch.tensor([20, 13, 7])
        last = model.prefill(tokens[:, :20], state, slots, lengths)
        assert (last - full[torch.arange(3), lengths - 1]).abs().max() < 1e-10
        assert state.positions.tolist() == [[13, 0, 20, 7]]
        # each row goes on from its own length, one token at a time
        for row, n in enumerate(lengths.tolist()):
            for t in range(n, n + 4):
                step = model.decode_step(tokens[row : row + 1, t], state, slots[row : row + 1])
                assert (step - full[row, t]).abs().max() < 1e-10, (row, t)
    assert state.kv_nbytes == analytic_kv_bytes(model.cfg, 48) * 4
    assert state.nbytes == analytic_state_bytes(model.cfg) * 4


def test_a_gla_model_is_unchanged_by_the_knob():
    """attn: null keeps the GLA model as it was: same parameter names and values, no K/V, no positions."""
    plain = _model(None)
    hybrid = _model({"layers": [3], "num_heads": 4})
    assert plain.cfg.gla_layers == (0, 1, 2, 3) and hybrid.cfg.gla_layers == (0, 1, 2)
    state = plain.allocate_state(2)
    assert state.keys is None and state.positions is None and state.recurrent.shape[0] == 4
    names = {n for n, _ in hybrid.named_parameters() if n.startswith("blocks.3.attn.")}
    assert names == {f"blocks.3.attn.{p}_proj.weight" for p in "qkvo"}
    with pytest.raises(ValueError, match="max_context"):
        hybrid.allocate_state(1)


def test_the_knob_fills_fla_defaults_and_keeps_its_form():
    spec = {"layers": (3,), "num_heads": 4}
    parsed = parse_attention_config(spec, 4)
    assert parsed == {
        "layers": [3],
        "num_heads": 4,
        "num_kv_heads": 4,
        "qkv_bias": False,
        "window_size": None,
        "rope_theta": 10000.0,
    }
    assert spec == {"layers": (3,), "num_heads": 4}  # the input is not modified
    assert isinstance(parse_attention_config([spec], 4), list)


BAD_SPECS = [
    ({"num_heads": 4}, 4),
    ({"layers": [0]}, 4),
    ({"layers": 3, "num_heads": 4}, 4),
    ({"layers": [4], "num_heads": 4}, 4),
    ({"layers": [-1], "num_heads": 4}, 4),
    ({"layers": [True], "num_heads": 4}, 4),
    ({"layers": [1, 1], "num_heads": 4}, 4),
    ([{"layers": [1], "num_heads": 4}, {"layers": [2, 1], "num_heads": 2}], 4),
    ({"layers": [1], "num_heads": 0}, 4),
    ({"layers": [1], "num_heads": 4, "num_kv_heads": 2.0}, 4),
    ({"layers": [1], "num_heads": 4, "qkv_bias": 1}, 4),
    ({"layers": [1], "num_heads": 4, "window_size": 0}, 4),
    ({"layers": [1], "num_heads": 4, "rope_theta": float("inf")}, 4),
    ({"layers": [1], "num_heads": 4, "rope_theta": -1}, 4),
    ("layers 1", 4),
    ([["layers"]], 4),
]


@pytest.mark.parametrize("attn,layers", BAD_SPECS)
def test_refusals_are_flas_word_for_word(attn, layers):
    fla_utils = pytest.importorskip("fla.models.configuration_utils")
    with pytest.raises(ValueError) as theirs:
        fla_utils.parse_attention_config(attn, num_hidden_layers=layers)
    with pytest.raises(AttentionSpecError) as ours:
        parse_attention_config(attn, layers)
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize(
    "attn,message",
    [
        (
            {"layers": [4], "num_heads": 4},
            "model.attn: attn specification field 'layers' contains out-of-range layer 4",
        ),
        ({"layers": [1], "num_heads": 3}, "model.attn.num_heads: 3 does not divide d_model=32"),
        ({"layers": [1], "num_heads": 4, "num_kv_heads": 3}, "model.attn.num_kv_heads: 3 does not divide num_heads=4"),
        ([{"layers": [1], "num_heads": 4, "qk_norm": True}], "model.attn[0].qk_norm: not an AttentionSpec field"),
    ],
)
def test_what_laplace_cannot_build_is_named(attn, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        validate_model_config(ModelConfig(vocab_size=64, d_model=D, n_layers=4, n_heads=2, attn=attn))


def test_bad_attention_knobs_are_one_line_and_exit_2():
    import subprocess
    import sys
    from pathlib import Path

    cases = {
        "model.attn={layers: [9], num_heads: 4}": "out-of-range layer 9",
        "model.attn={layers: [1], num_heads: 3}": "model.attn.num_heads: 3 does not divide d_model=256",
        "model.attn={layers: [1], num_heads: 4, window_size: 4096}": "larger than the context, engine.max_context=2048",
    }
    for override, message in cases.items():
        run = subprocess.run(
            [sys.executable, "-m", "laplace.pipeline.cli", "info", "--set", override],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parents[1],  # the project's params.yaml; `laplace info` writes nothing
        )
        assert run.returncode == 2, (override, run.stderr)
        lines = run.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], (override, run.stderr)


def test_presets_put_attention_where_their_names_say():
    tiny_hybrid = preset_model_config("tiny-hybrid", vocab_size=4096)
    assert tiny_hybrid.attn_layers == (3,) and tiny_hybrid.gla_layers == (0, 1, 2)
    assert preset_model_config("tiny-attn", vocab_size=4096).gla_layers == ()
    assert preset_model_config("small-hybrid", vocab_size=16384).attn_layers == (3, 7, 11)
    big = preset_model_config("laplace-3b-hybrid-24to1")
    assert big.attn_layers == (23,) and len(big.gla_layers) == 23
    for name in PRESETS:
        validate_model_config(preset_model_config(name, vocab_size=None if PRESETS[name]["vocab_size"] else 4096))


def test_sequence_bytes_follow_the_formula_and_the_allocation():
    """laplace-3b-hybrid-24to1 in bf16: the GLA state of 23 layers plus 2 * 8 kv heads * 128 * 2 bytes per token."""
    cfg = preset_model_config("laplace-3b-hybrid-24to1")
    per_token = 2 * 8 * 128 * 2
    assert analytic_kv_bytes(cfg, 8192) == 8192 * per_token
    gla = preset_model_config("laplace-3b")
    assert analytic_state_bytes(cfg) * 24 == analytic_state_bytes(gla) * 23
    got = sequence_bytes(cfg, 2048)
    assert got["total_bytes"] == got["state_bytes"] + got["kv_bytes"] == analytic_state_bytes(cfg) + 2048 * per_token
    small = _model(HYBRID, dtype="float32")
    state = State.allocate(small.cfg, 3, max_context=100)
    assert state.kv_bytes_per_sequence == sequence_bytes(small.cfg, 100)["kv_bytes"]
    assert state.bytes_per_sequence == sequence_bytes(small.cfg, 100)["state_bytes"]
