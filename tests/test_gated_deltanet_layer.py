"""Gated DeltaNet inside the model: layer selection by config, prefill + decode against the training
forward in a GLA + GDN + attention mix, state accounting, the config's refusals, the optimizer's
routing, the kernels' op machinery, and a few training steps.

Tolerances: the model-level comparisons are fp32 against fp32 forms of the same function (chunked
vs step), whose measured spread is ~1e-6 relative (tests/test_gated_deltanet.py); 1e-5 as there."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_rms

from laplace.errors import ConfigError
from laplace.model import kernels
from laplace.model.config import ModelConfig, architecture_family, preset_model_config, validate_model_config
from laplace.model.gated_deltanet import chunk_gated_delta_rule, l2_normalize
from laplace.model.gated_deltanet_layer import GatedDeltaNet
from laplace.model.lm import LaplaceLM, State, analytic_state_bytes
from laplace.optim.muon import route_parameters

TOL = 1e-5
GDN = {"num_heads": 1, "num_v_heads": 2, "head_dim": 16, "expand_v": 1.5}  # GVA, Vh = 24


def mixed_config(**over) -> ModelConfig:
    """Layer 0 Gated DeltaNet, 1 softmax attention, 2 GLA, 3 Gated DeltaNet: every kind at once."""
    values = dict(
        vocab_size=200,
        d_model=32,
        n_layers=4,
        n_heads=2,
        chunk_size=16,
        sub_chunk_size=8,
        kernel="torch",
        attn={"layers": [1], "num_heads": 2},
        gdn={"layers": [0, 3], **GDN},
    )
    return validate_model_config(ModelConfig(**{**values, **over}))


def test_layers_are_chosen_by_the_config():
    cfg = mixed_config()
    torch.manual_seed(0)
    model = LaplaceLM(cfg)
    kinds = [type(b.attn).__name__ for b in model.blocks]
    assert kinds == ["GatedDeltaNet", "SoftmaxAttention", "GatedLinearAttention", "GatedDeltaNet"]
    assert cfg.gla_layers == (2,) and cfg.gdn_layers == (0, 3) and cfg.attn_layers == (1,)
    assert architecture_family(cfg) == "hybrid"
    assert architecture_family(preset_model_config("tiny-gdn", vocab_size=64)) == "gated_deltanet"
    layer = model.blocks[0].attn
    # fla's initialisation: A = exp(A_log) in (0, 16), dt = softplus(dt_bias) in [1e-3, 0.1]
    assert 0 < layer.A_log.exp().min() and layer.A_log.exp().max() < 16
    dt = F.softplus(layer.dt_bias)
    assert 1e-3 * 0.999 <= dt.min() and dt.max() <= 0.1 * 1.001


@pytest.mark.parametrize("conv", [True, False])
def test_prefill_then_decode_reproduce_the_training_forward(conv):
    cfg = mixed_config(use_short_conv=conv)
    torch.manual_seed(0)
    model = LaplaceLM(cfg).eval()
    tokens = torch.randint(0, 200, (2, 41), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)
        state = model.allocate_state(2, max_context=64)
        first = model.prefill(tokens[:, :25], state, all_logits=True)
        steps = [model.decode_step(tokens[:, t], state) for t in range(25, 41)]
    assert rel_rms(first, full[:, :25]) <= TOL
    assert rel_rms(torch.stack(steps, 1), full[:, 25:]) <= TOL


def test_padded_prefill_into_slots_equals_each_row_alone():
    cfg = mixed_config()
    torch.manual_seed(0)
    model = LaplaceLM(cfg).eval()
    tokens = torch.randint(0, 200, (2, 30), generator=torch.Generator().manual_seed(2))
    lengths = torch.tensor([30, 11])
    with torch.no_grad():
        pool = model.allocate_state(5, max_context=32)
        pool.delta.fill_(3.0)
        slots = torch.tensor([3, 1])
        before = pool.clone()
        pool.zero_(slots)
        last = model.prefill(tokens, pool, slots=slots, lengths=lengths)
        for row, n in enumerate(lengths.tolist()):
            alone = model.allocate_state(1, max_context=32)
            last_alone = model.prefill(tokens[row : row + 1, :n], alone)
            assert rel_rms(last[row], last_alone[0]) <= TOL
            assert rel_rms(pool.delta[:, slots[row]], alone.delta[:, 0]) <= TOL
            assert rel_rms(pool.delta_conv[:, slots[row]], alone.delta_conv[:, 0]) <= TOL
    untouched = torch.tensor([0, 2, 4])
    assert torch.equal(pool.delta[:, untouched], before.delta[:, untouched])


def test_state_bytes_count_the_matrix_state_and_the_conv_state():
    """State.allocate (on meta) equals the formula; for tiny-gdn by hand: 4 layers x (HV=2 x 64 x 128
    fp32 + 3 conv positions x (2*128 + 256) fp32)."""
    for name in ("tiny-gdn", "tiny-gdn-hybrid", "laplace-3b-gdn", "laplace-3b-gdn-hybrid-7to1"):
        cfg = preset_model_config(name, vocab_size=64)
        state = State.allocate(cfg, batch=2, device="meta", max_context=0)
        assert state.bytes_per_sequence == analytic_state_bytes(cfg), name
    tiny = preset_model_config("tiny-gdn", vocab_size=64)
    assert analytic_state_bytes(tiny) == 4 * (2 * 64 * 128 * 4 + 3 * (2 * 128 + 256) * 4) == 286_720
    mixed = State.allocate(mixed_config(), batch=1, device="meta", max_context=0)
    assert mixed.delta.shape == (2, 1, 2, 16, 24) and mixed.recurrent.shape == (1, 1, 2, 8, 16)


@pytest.mark.parametrize(
    "gdn,match",
    [
        ({"layers": [0], "num_heads": 2, "head_dim": 16, "use_gate": False}, r"model\.gdn\.use_gate: not a Gated"),
        ({"layers": [1], "num_heads": 2, "head_dim": 16}, r"model\.gdn\.layers: layer 1 is also an attention"),
        ({"layers": [0, 9], "num_heads": 2}, r"model\.gdn\.layers: a list of layer indices in \[0, 4\)"),
        ({"layers": [0], "num_heads": 2, "num_v_heads": 3}, r"model\.gdn\.num_v_heads: 3 is not a multiple"),
        ({"layers": [0], "head_dim": 15, "expand_v": 0.5}, r"model\.gdn\.expand_v: head_dim \* expand_v = 7\.5"),
    ],
)
def test_the_config_refuses_what_fla_refuses_naming_the_key(gdn, match):
    with pytest.raises(ConfigError, match=match):
        mixed_config(gdn=gdn)


def test_muon_takes_the_matrices_and_adamw_the_decay_parameters_and_convolutions():
    model = LaplaceLM(mixed_config())
    groups = {name: group for group, params in route_parameters(model).items() for name, _ in params}
    for name in ("A_log", "dt_bias", "q_conv.weight", "o_norm.weight"):
        assert groups[f"blocks.0.attn.{name}"] == "adamw_no_decay", name
    for name in ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj", "o_proj"):
        assert groups[f"blocks.0.attn.{name}.weight"] == "muon", name


def test_the_chunk_op_runs_the_torch_form_with_its_gradients():
    """The custom op (what the fla kernels go through on CUDA) driven by the torch form: the same
    outputs and gradients as the direct call, padding and an initial state included."""
    gen = torch.Generator().manual_seed(3)
    B, T, H, HV, K, V = 2, 21, 1, 2, 8, 12
    base = [
        l2_normalize(torch.randn(B, T, H, K, generator=gen)),
        l2_normalize(torch.randn(B, T, H, K, generator=gen)),
        torch.randn(B, T, HV, V, generator=gen),
        -torch.rand(B, T, HV, generator=gen),
        torch.rand(B, T, HV, generator=gen),
        torch.randn(B, HV, K, V, generator=gen),
    ]
    lengths = torch.tensor([21, 9])

    def run(fn):
        leaves = [x.clone().requires_grad_() for x in base]
        o, S = fn(*leaves)
        (o.sin().sum() + S.pow(2).sum()).backward()
        return o, S, [x.grad for x in leaves]

    o_op, S_op, g_op = run(lambda *xs: kernels.gdn_chunk_op(*xs, lengths, K**-0.5, 8, 2048, "torch"))
    o_ref, S_ref, g_ref = run(
        lambda q, k, v, g, b, h0: chunk_gated_delta_rule(q, k, v, g, b, initial_state=h0, lengths=lengths, chunk_size=8)
    )
    assert rel_rms(o_op, o_ref) <= 1e-6 and rel_rms(S_op, S_ref) <= 1e-6
    for name, a, b in zip(("q", "k", "v", "g", "beta", "h0"), g_op, g_ref):
        assert rel_rms(a, b) <= 1e-6, name
    assert g_op[2][1, 9:].abs().max() == 0  # padded values get no gradient: they are no-ops


def test_a_small_gdn_model_learns():
    """20 AdamW steps on one batch of a repeating pattern: the loss falls by more than half."""
    cfg = dataclasses.replace(mixed_config(), attn=None, gdn={"layers": [0, 1, 2, 3], **GDN})
    torch.manual_seed(0)
    model = LaplaceLM(validate_model_config(cfg))
    tokens = torch.arange(33).remainder(7).repeat(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(20):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_the_layer_computes_its_gates_in_fp32_under_bf16():
    cfg = mixed_config(dtype="bfloat16")
    torch.manual_seed(0)
    layer = GatedDeltaNet(cfg).to(torch.bfloat16)
    with torch.no_grad():
        layer.A_log.fill_(0.0)
        layer.dt_bias.fill_(0.5)
    x = torch.randn(1, 5, 32, dtype=torch.bfloat16)
    q, k, v, g, beta, _ = layer._inputs(x, None, None)
    assert g.dtype == beta.dtype == q.dtype == torch.float32 and v.dtype == torch.bfloat16
    assert torch.allclose(q.norm(dim=-1), torch.ones(()), atol=1e-5)


def test_info_reports_the_gdn_state_beside_the_kv_cache():
    from laplace.model.facts import model_facts

    facts = model_facts(preset_model_config("tiny-gdn", vocab_size=4096))
    assert facts["gdn_layers"] == [0, 1, 2, 3] and facts["gla_layers"] == []
    assert facts["state_delta_bytes"] == 4 * 2 * 64 * 128 * 4
    assert facts["state_delta_conv_bytes"] == 4 * 3 * (2 * 128 + 256) * 4
    assert facts["state_bytes_per_sequence"] == facts["state_delta_bytes"] + facts["state_delta_conv_bytes"]
    assert facts["state_vs_kv_8192"] == facts["kv_cache_bytes_8192"] / 286_720


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_keeps_the_gradients(mode):
    """The recompute reruns the same fp32 ops in the same order: gradients equal to ~1 ulp."""
    from laplace.training.activation_checkpoint import apply_activation_checkpointing

    tokens = torch.randint(0, 200, (2, 20), generator=torch.Generator().manual_seed(4))
    grads = []
    for ac in ("none", mode):
        torch.manual_seed(0)
        model = LaplaceLM(mixed_config())
        apply_activation_checkpointing(model, ac)
        F.cross_entropy(model(tokens).reshape(-1, 200), tokens.reshape(-1)).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        assert rel_rms(grads[1][name], g) <= 1e-6, name


def test_the_plan_probes_one_block_per_kind_of_layer():
    from laplace.training.activations import _probe_config, activation_bytes

    probe, which = _probe_config(mixed_config())
    assert probe.gla_layers == (0,) and probe.gdn_layers == (1,) and probe.attn_layers == (2,)
    assert which == [1, 2, 0, 1]  # layers 0 and 3 GDN, 1 attention, 2 GLA
    out = activation_bytes(mixed_config(), micro_batch=1, seq_len=32, dtype=torch.float32)
    assert out["peak_bytes"]["full"] < out["peak_bytes"]["none"] and out["attention_layers"] == 1


def test_dt_init_range_sets_the_decays_init_and_leaves_default_models_unchanged():
    """model.gdn.dt_init_range: dt = softplus(dt_bias) drawn log-uniformly in it (fla's [1e-3, 0.1] by
    default); at its default it is not part of the spec's normal form, so a model that never set it
    keeps its architecture (exports, fingerprints) and its initial weights."""
    plain = mixed_config()
    assert "dt_init_range" not in plain.gdn
    assert mixed_config(gdn={"layers": [0, 3], **GDN, "dt_init_range": [0.001, 0.1]}) == plain
    long = mixed_config(gdn={"layers": [0, 3], **GDN, "dt_init_range": [1e-4, 1e-3]})
    assert long.gdn["dt_init_range"] == [1e-4, 1e-3] and long.architecture() != plain.architecture()
    torch.manual_seed(0)
    a = LaplaceLM(plain)
    torch.manual_seed(0)
    b = LaplaceLM(long)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        if not name.endswith("dt_bias"):
            assert torch.equal(p, q), name  # only dt_bias draws from the range
    dt = F.softplus(b.blocks[0].attn.dt_bias)
    assert 1e-4 * 0.999 <= dt.min() and dt.max() <= 1e-3 * 1.001
    with pytest.raises(ConfigError, match=r"model\.gdn\.dt_init_range: must be \[low, high\]"):
        mixed_config(gdn={"layers": [0], **GDN, "dt_init_range": [1e-3, 1e-4]})


def test_the_mqar_probe_trains_a_gdn_model_with_glas_state_and_long_memory():
    """The probe's small model of a GDN architecture is GDN (not GLA in its place), with a GLA layer's
    key/value widths and heads (the same state) and probes.mqar_train_gdn_dt_init's decays."""
    from laplace.config import ProbesSection
    from laplace.evals.mqar import mqar_model_config, state_floats

    probes = ProbesSection()
    gla = mqar_model_config(probes)
    for preset, layers, attn in (("tiny-gdn", (0, 1), ()), ("tiny-gdn-hybrid", (0,), (1,))):
        cfg = mqar_model_config(probes, like=preset_model_config(preset, vocab_size=64))
        assert cfg.gdn_layers == layers and cfg.attn_layers == attn and not cfg.gla_layers, preset
        assert cfg.gdn["dt_init_range"] == probes.mqar_train_gdn_dt_init
        assert state_floats(cfg) == state_floats(gla) * len(layers) // 2
    pure = mqar_model_config(probes, like=preset_model_config("tiny-gdn", vocab_size=64))
    assert analytic_state_bytes(pure) == analytic_state_bytes(gla)


def test_the_fla_decode_step_through_our_dispatch_equals_the_torch_step():
    """fla's own fused_recurrent_gated_delta_rule Triton kernel, run by Triton's CPU interpreter (in a
    subprocess: TRITON_INTERPRET must be set before triton is imported), called as kernels.py calls it
    on CUDA (GVA, an initial state). fp32 both sides, measured 9e-8: bound 1e-5. (fla's chunked
    kernel does not run under the interpreter; it is exercised on a GPU only.)"""
    pytest.importorskip("fla")
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys; sys.path.insert(0, 'tests'); import fla_cpu_forward, torch\n"
        "from laplace.model import kernels\n"
        "from laplace.model.gated_deltanet import gated_delta_step, l2_normalize\n"
        "gen = torch.Generator().manual_seed(0)\n"
        "q, k = (l2_normalize(torch.randn(2, 1, 16, generator=gen)) for _ in range(2))\n"
        "v = torch.randn(2, 2, 32, generator=gen)\n"
        "g, beta = -torch.rand(2, 2, generator=gen), torch.rand(2, 2, generator=gen)\n"
        "h0 = torch.randn(2, 2, 16, 32, generator=gen)\n"
        "o, S = kernels._fla_gdn_step(q, k, v, g, beta, h0, 0.25)\n"
        "r, R = gated_delta_step(q, k, v, g, beta, h0)\n"
        "rel = lambda a, b: float((a - b).norm() / b.norm())\n"
        "print(rel(o, r), rel(S, R))\n"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    err_o, err_S = map(float, out.stdout.split()[-2:])
    assert err_o <= 1e-5 and err_S <= 1e-5, out.stdout
