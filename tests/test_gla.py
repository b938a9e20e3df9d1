"""The three GLA forms agree: chunked vs naive (fp64 reference) vs recurrent."""

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_rms

from laplace.model.gla import chunk_gla, gla_step, min_log_decay, naive_gla

B, H, K, V = 2, 3, 16, 24


def inputs(T, decay="normal", dtype=torch.float32, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    if decay == "normal":  # the model's gate: logsigmoid / 16
        g = F.logsigmoid(torch.randn(B, T, H, K, generator=gen)) / 16
    else:  # strong: -0.75 .. -3 per token, cumulative far below -88 inside a chunk of 128
        g = -0.75 - 2.25 * torch.rand(B, T, H, K, generator=gen)
    return [x.to(device, dtype) for x in (q, k, v, g)]


def reference(q, k, v, g, initial_state=None):
    init = None if initial_state is None else initial_state.double()
    return naive_gla(q.double(), k.double(), v.double(), g.double(), initial_state=init)


def run_recurrent(q, k, v, g, state=None):
    S = q.new_zeros(B, H, K, V, dtype=torch.float32) if state is None else state.clone()
    outs = []
    for t in range(q.shape[1]):
        o, S = gla_step(q[:, t], k[:, t], v[:, t], g[:, t], S)
        outs.append(o)
    return torch.stack(outs, 1), S


@pytest.mark.parametrize("T", [1, 37, 64, 100, 256])
@pytest.mark.parametrize("chunk,sub", [(16, 16), (64, 16), (128, 32)])
def test_chunked_and_recurrent_match_naive_fp32(T, chunk, sub, device):
    q, k, v, g = inputs(T, device=device)
    o_ref, S_ref = reference(q, k, v, g)
    o, S = chunk_gla(q, k, v, g, chunk_size=chunk, sub_chunk_size=sub)
    assert o.dtype == torch.float32 and S.dtype == torch.float32
    assert rel_rms(o, o_ref) <= 1e-5
    assert rel_rms(S, S_ref) <= 1e-5
    o_r, S_r = run_recurrent(q, k, v, g)
    assert rel_rms(o_r, o_ref) <= 1e-5
    assert rel_rms(S_r, S_ref) <= 1e-5


def test_strong_decay_at_chunk_128_is_exact_and_finite(device):
    T = 256
    q, k, v, g = inputs(T, decay="strong", device=device)
    in_chunk = g[:, :128].sum(1)  # cumulative log-decay over one chunk of 128, per channel
    assert in_chunk.max() < -88 * 1.05, "the case must be past fp32 exp overflow"
    # the textbook factorisation overflows here: exp(-cumsum) is inf in fp32
    assert torch.isinf(torch.exp(-g[:, :128].cumsum(1))).any()
    o_ref, S_ref = reference(q, k, v, g)
    o, S = chunk_gla(q, k, v, g, chunk_size=128, sub_chunk_size=16)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert rel_rms(o, o_ref) <= 1e-5
    assert rel_rms(S, S_ref) <= 1e-5


def test_bf16_inputs_accumulate_in_fp32(device):
    q, k, v, g = inputs(100, dtype=torch.bfloat16, device=device)
    o_ref, S_ref = reference(q, k, v, g)
    o, S = chunk_gla(q, k, v, g, chunk_size=64)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    assert rel_rms(o, o_ref) <= 1e-2
    assert rel_rms(S, S_ref) <= 1e-2
    o_r, S_r = run_recurrent(q, k, v, g)
    assert rel_rms(o_r, o_ref) <= 1e-2 and rel_rms(S_r, S_ref) <= 1e-2


def test_under_bf16_autocast_the_recurrence_stays_fp32(device):
    q, k, v, g = inputs(100, device=device)
    o_ref, S_ref = reference(q, k, v, g)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        o, S = chunk_gla(q, k, v, g, chunk_size=64)
    assert S.dtype == torch.float32
    # were the matmuls down-cast to bf16 the error would be ~1e-3; fp32 keeps it at ~1e-7
    assert rel_rms(o, o_ref) <= 1e-5


def test_gradients_chunked_vs_naive_fp32(device):
    T = 77
    base = inputs(T, device=device)
    leaves_c = [x.clone().requires_grad_() for x in base]
    leaves_n = [x.double().clone().requires_grad_() for x in base]
    w = torch.randn(B, T, H, V, generator=torch.Generator().manual_seed(5)).to(device)
    o_c, S_c = chunk_gla(*leaves_c, chunk_size=32, sub_chunk_size=8)
    ((o_c * w).sum() + S_c.pow(2).sum() * 0.1).backward()
    o_n, S_n = naive_gla(*leaves_n)
    ((o_n * w.double()).sum() + S_n.pow(2).sum() * 0.1).backward()
    for name, a, b in zip("qkvg", leaves_c, leaves_n):
        assert rel_rms(a.grad, b.grad) <= 1e-4, name


def test_initial_state_continues_the_sequence(device):
    q, k, v, g = inputs(150, device=device)
    o_ref, S_ref = reference(q, k, v, g)
    o1, S1 = chunk_gla(q[:, :70], k[:, :70], v[:, :70], g[:, :70], chunk_size=32)
    o2, S2 = chunk_gla(q[:, 70:], k[:, 70:], v[:, 70:], g[:, 70:], initial_state=S1, chunk_size=32)
    assert rel_rms(torch.cat([o1, o2], 1), o_ref) <= 1e-5
    assert rel_rms(S2, S_ref) <= 1e-5


def test_padded_positions_are_exact_no_ops_even_with_nan(device):
    T = 90
    q, k, v, g = inputs(T, device=device)
    lengths = torch.tensor([90, 41], device=device)
    qn, kn, vn, gn = (x.clone() for x in (q, k, v, g))
    for x in (qn, kn, vn, gn):
        x[1, 41:] = float("nan")  # garbage after the real tokens of row 1
    o, S = chunk_gla(qn, kn, vn, gn, lengths=lengths, chunk_size=32)
    _, S_row1 = reference(q[1:, :41], k[1:, :41], v[1:, :41], g[1:, :41])
    o_row1, _ = chunk_gla(q[1:, :41], k[1:, :41], v[1:, :41], g[1:, :41], chunk_size=32)
    assert torch.isfinite(S).all()
    assert rel_rms(S[1:], S_row1) <= 1e-5
    assert torch.equal(o[1:, :41], o_row1)  # real positions are untouched, bit for bit
    _, S_row0 = reference(q[:1], k[:1], v[:1], g[:1])
    assert rel_rms(S[:1], S_row0) <= 1e-5


def test_chunked_form_compiles_to_one_static_graph(device):
    q, k, v, g = inputs(64, device=device)
    compiled = torch.compile(
        lambda q, k, v, g: chunk_gla(q, k, v, g, chunk_size=32, sub_chunk_size=16), fullgraph=True, dynamic=False
    )
    o_c, S_c = compiled(q, k, v, g)
    o_ref, S_ref = reference(q, k, v, g)
    assert rel_rms(o_c, o_ref) <= 1e-5 and rel_rms(S_c, S_ref) <= 1e-5


@pytest.mark.parametrize("sub", [8, 16, 32])
def test_exact_at_the_decay_floor(sub, device):
    """At g = min_log_decay(sub) everywhere the sub-chunk factors reach e^+-80: still finite and exact."""
    T = 128
    q, k, v, _ = inputs(T, device=device)
    g = torch.full_like(q, min_log_decay(sub))
    o_ref, S_ref = reference(q, k, v, g)
    o, S = chunk_gla(q, k, v, g, chunk_size=64, sub_chunk_size=sub)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert rel_rms(o, o_ref) <= 1e-5
    assert rel_rms(S, S_ref) <= 1e-5
    # and gradients stay finite there
    q, k, v, g = (x.clone().requires_grad_() for x in (q, k, v, g))
    o, _ = chunk_gla(q, k, v, g, chunk_size=64, sub_chunk_size=sub)
    o.square().sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v, g))


def test_the_layer_clamps_its_gate_at_the_floor():
    from laplace.model.config import preset_model_config
    from laplace.model.lm import GatedLinearAttention

    cfg = preset_model_config("tiny", vocab_size=64, d_model=32, n_heads=2)
    layer = GatedLinearAttention(cfg)
    with torch.no_grad():
        layer.gk_proj[1].bias.fill_(-1e4)  # a gate logit far below the floor
        _, _, _, gk, _ = layer._qkvg(torch.randn(1, 8, 32), None, None)
    assert gk.min().item() == min_log_decay(cfg.sub_chunk_size) == -10.0


def test_segments_carry_the_state_exactly(device):
    """Long inputs run in segments of `segment_len`; any segmentation is the same recurrence."""
    T = 300
    q, k, v, g = inputs(T, device=device)
    lengths = torch.tensor([300, 211], device=device)
    o_ref, _ = naive_gla(
        *(
            x.double()
            for x in (
                q,
                k,
                v,
                torch.where((torch.arange(T, device=device) < lengths[:, None])[:, :, None, None], g, 0.0),
            )
        )
    )
    one, S_one = chunk_gla(q, k, v, g, lengths=lengths, chunk_size=32, segment_len=4096)
    many, S_many = chunk_gla(q, k, v, g, lengths=lengths, chunk_size=32, segment_len=64)
    assert rel_rms(many, one) <= 1e-6 and rel_rms(S_many, S_one) <= 1e-6
    assert rel_rms(many[0], o_ref[0]) <= 1e-5


def gradients(lo: float, hi: float, device, T: int = 128, chunk: int = 64, sub: int = 16):
    """(chunked fp32, naive fp64) gradients of q, k, v, g for gates uniform in [lo, hi]."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, T, H, n, generator=gen) for n in (K, K, V))
    g = lo + (hi - lo) * torch.rand(B, T, H, K, generator=gen)
    w = torch.randn(B, T, H, V, generator=gen)
    base = [x.to(device) for x in (q, k, v, g)]
    leaves_c = [x.clone().requires_grad_() for x in base]
    leaves_n = [x.double().clone().requires_grad_() for x in base]
    o_c, S_c = chunk_gla(*leaves_c, chunk_size=chunk, sub_chunk_size=sub)
    ((o_c * w.to(device)).sum() + S_c.pow(2).sum() * 0.1).backward()
    o_n, S_n = naive_gla(*leaves_n)
    ((o_n * w.to(device).double()).sum() + S_n.pow(2).sum() * 0.1).backward()
    return leaves_c, leaves_n


@pytest.mark.parametrize(
    "lo, hi, g_rel_max",
    [(-0.1, 0.0, 1e-5), (-3.0, -0.75, 5e-6), (-10.0, -5.0, 5e-4)],  # measured: 2e-7, 1.7e-6, 1.4e-4
)
def test_gradients_under_strong_decays_stay_within_the_stated_bounds(lo, hi, g_rel_max, device):
    chunked, naive = gradients(lo, hi, device)
    for name, a, b in zip("qkv", chunked, naive):
        assert rel_rms(a.grad, b.grad) <= 1e-6, name
    dg_c, dg_n = chunked[3].grad.double(), naive[3].grad
    assert rel_rms(dg_c, dg_n) <= g_rel_max
    # the absolute error is fp32 rounding of the q*dq scale, whatever the decay
    scale = (naive[0].detach() * naive[0].grad).pow(2).mean().sqrt()
    assert ((dg_c - dg_n).pow(2).mean().sqrt() / scale).item() <= 2e-6


def test_below_the_floor_the_op_clamps_instead_of_returning_nan(device):
    q, k, v, _ = inputs(64, device=device)
    g = torch.full_like(q, -11.0)  # below the floor of sub-chunk 16
    o, S = chunk_gla(q, k, v, g, chunk_size=32, sub_chunk_size=16)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    o_ref, S_ref = reference(q, k, v, g.clamp_min(min_log_decay(16)))
    assert rel_rms(o, o_ref) <= 1e-5 and rel_rms(S, S_ref) <= 1e-5


def test_large_keys_within_the_documented_bound_stay_exact_at_the_floor(device):
    q, k, v, _ = inputs(64, device=device)
    k = k * 1e3  # |k| up to ~4e3 < 6.1e3: k * e^80 still fits fp32
    g = torch.full_like(q, min_log_decay(16))
    o, S = chunk_gla(q, k, v, g, chunk_size=64, sub_chunk_size=16)
    o_ref, S_ref = reference(q, k, v, g)
    assert torch.isfinite(o).all() and rel_rms(o, o_ref) <= 1e-5 and rel_rms(S, S_ref) <= 1e-5


def test_the_fp64_layer_computes_its_gate_in_fp64():
    from laplace.model.config import preset_model_config
    from laplace.model.lm import GatedLinearAttention

    cfg = preset_model_config("tiny", vocab_size=64, d_model=32, n_heads=2)
    layer = GatedLinearAttention(cfg).double()
    x = torch.randn(1, 8, 32, dtype=torch.float64)
    with torch.no_grad():
        _, _, _, gk, _ = layer._qkvg(x, None, None)
        exact = (F.logsigmoid(layer.gk_proj(x)) / cfg.gate_logit_normalizer).view_as(gk)
        via_fp32 = (F.logsigmoid(layer.gk_proj(x).float()) / cfg.gate_logit_normalizer).double().view_as(gk)
    assert gk.dtype == torch.float64
    assert torch.equal(gk, exact)  # not rounded through fp32 (which differs by ~1e-9)
    assert (via_fp32 - exact).abs().max() > 0
