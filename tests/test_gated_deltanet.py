"""The three gated delta rule forms agree: chunked and step vs the naive recurrence in fp64, and
vs fla's own naive forms on identical inputs.

Tolerances: every comparison is fp32 against the fp64 naive form, measured as relative RMS
(conftest.rel_rms). Measured over 6 seeds x lengths 37..100 x chunks 16..64 x GVA or not x both
decays: outputs and states <= 1.0e-6; gradients of q, k, v, beta and the initial state <= 6.8e-7,
of the gate <= 9.7e-7 (normal decays) and 9.3e-6 (strong: the true gate gradient shrinks while the
absolute error stays, as for GLA's gate in tests/test_gla.py). The bounds below are 10x those;
a wrong term (a missing decay or beta factor) gives errors of order 1e-1.
"""

import pytest
import torch
from conftest import rel_rms

from laplace.model.gated_deltanet import (
    chunk_gated_delta_rule,
    expand_heads,
    gated_delta_step,
    l2_normalize,
    naive_gated_delta_rule,
)

B, K, V = 2, 16, 24
FWD_TOL, GRAD_TOL, STRONG_GATE_GRAD_TOL = 1e-5, 1e-5, 1e-4


def inputs(T, H=2, HV=2, decay="normal", seed=0, with_state=False):
    """q, k L2-normalised as the layer feeds them; beta in (0, 1); g the log decay.
    normal: -0.5 .. 0 per token; strong: -8 .. -1 (A = exp(A_log) up to 16 in the layer)."""
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(B, T, H, K, generator=gen))
    k = l2_normalize(torch.randn(B, T, H, K, generator=gen))
    v = torch.randn(B, T, HV, V, generator=gen)
    u = torch.rand(B, T, HV, generator=gen)
    g = -0.5 * u if decay == "normal" else -1 - 7 * u
    beta = torch.rand(B, T, HV, generator=gen)
    h0 = torch.randn(B, HV, K, V, generator=gen) if with_state else None
    return q, k, v, g, beta, h0


def reference(q, k, v, g, beta, h0=None):
    return naive_gated_delta_rule(
        *(x.double() for x in (q, k, v, g, beta)), initial_state=None if h0 is None else h0.double()
    )


@pytest.mark.parametrize("T,chunk", [(1, 16), (37, 16), (64, 32), (100, 64)])
@pytest.mark.parametrize("H,HV", [(2, 2), (1, 3)])  # (1, 3): GVA, three value heads per key head
def test_chunked_matches_naive_fp64(T, chunk, H, HV):
    q, k, v, g, beta, h0 = inputs(T, H, HV, with_state=True)
    o_ref, S_ref = reference(q, k, v, g, beta, h0)
    o, S = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, chunk_size=chunk)
    assert o.dtype == torch.float32 and S.dtype == torch.float32
    assert rel_rms(o, o_ref) <= FWD_TOL
    assert rel_rms(S, S_ref) <= FWD_TOL


@pytest.mark.parametrize("decay,chunk,H,HV", [("normal", 16, 2, 2), ("strong", 32, 1, 2)])
def test_gradients_chunked_vs_naive(decay, chunk, H, HV):
    """Every input's gradient (q, k, v, g, beta, initial state), through a loss on o and on the
    final state, at a length (45) that is not a multiple of the chunk."""
    T = 45
    base = inputs(T, H, HV, decay=decay, seed=1, with_state=True)
    leaves_c = [x.clone().requires_grad_() for x in base]
    leaves_n = [x.double().clone().requires_grad_() for x in base]
    w = torch.randn(B, T, HV, V, generator=torch.Generator().manual_seed(5))
    o_c, S_c = chunk_gated_delta_rule(*leaves_c[:5], initial_state=leaves_c[5], chunk_size=chunk)
    ((o_c * w).sum() + S_c.pow(2).sum() * 0.1).backward()
    o_n, S_n = naive_gated_delta_rule(*leaves_n[:5], initial_state=leaves_n[5])
    ((o_n * w.double()).sum() + S_n.pow(2).sum() * 0.1).backward()
    for name, a, b in zip(("q", "k", "v", "g", "beta", "h0"), leaves_c, leaves_n):
        tol = STRONG_GATE_GRAD_TOL if (name, decay) == ("g", "strong") else GRAD_TOL
        assert rel_rms(a.grad, b.grad) <= tol, name


def test_decode_steps_continue_a_chunked_prefill():
    """Prefill 40 tokens chunked, then step 13 tokens: the outputs and state of the chunked form
    over all 53 (GVA, so the step's head mapping is checked too)."""
    q, k, v, g, beta, _ = inputs(53, 1, 2, seed=2)
    o_all, S_all = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16)
    _, S = chunk_gated_delta_rule(q[:, :40], k[:, :40], v[:, :40], g[:, :40], beta[:, :40], chunk_size=16)
    outs = []
    for t in range(40, 53):
        o, S = gated_delta_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], S)
        outs.append(o)
    assert rel_rms(torch.stack(outs, 1), o_all[:, 40:]) <= FWD_TOL
    assert rel_rms(S, S_all) <= FWD_TOL


def test_segments_and_padding_are_exact():
    """Segments carry the state (segment 32 over 90 tokens = one pass); positions past a row's
    length are no-ops even when they hold NaN."""
    q, k, v, g, beta, _ = inputs(90, seed=3)
    o_ref, S_ref = reference(q, k, v, g, beta)
    o, S = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16, segment_len=32)
    assert rel_rms(o, o_ref) <= FWD_TOL and rel_rms(S, S_ref) <= FWD_TOL

    noisy = [x.clone() for x in (q, k, v, g, beta)]
    for x in noisy:
        x[1, 41:] = float("nan")
    o_p, S_p = chunk_gated_delta_rule(*noisy, lengths=torch.tensor([90, 41]), chunk_size=16)
    _, S_row1 = reference(*(x[1:, :41] for x in (q, k, v, g, beta)))
    assert torch.isfinite(S_p).all()
    assert rel_rms(S_p[1:], S_row1) <= FWD_TOL
    assert rel_rms(S_p[:1], S_ref[:1]) <= FWD_TOL
    assert rel_rms(o_p[1:, :41], o_ref[1:, :41]) <= FWD_TOL


def test_agrees_with_fla_naive_forms():
    """fla.ops.gated_delta_rule.naive (its recurrent and chunked references, fp32, CPU) on the
    same inputs; GVA expanded for them (their naive forms take H = HV)."""
    naive = pytest.importorskip("fla.ops.gated_delta_rule.naive")
    q, k, v, g, beta, h0 = inputs(70, 1, 2, seed=4, with_state=True)
    o, S = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, chunk_size=32)
    qe, ke = expand_heads(q, 2), expand_heads(k, 2)
    o_r, S_r = naive.naive_recurrent_gated_delta_rule(qe, ke, v, beta, g, initial_state=h0, output_final_state=True)
    o_c, S_c = naive.naive_chunk_gated_delta_rule(
        qe, ke, v, g, beta, chunk_size=32, initial_state=h0, output_final_state=True
    )
    for o_fla, S_fla in ((o_r, S_r), (o_c, S_c)):
        assert rel_rms(o, o_fla) <= FWD_TOL and rel_rms(S, S_fla) <= FWD_TOL


def test_under_bf16_autocast_and_bf16_inputs_the_recurrence_stays_fp32():
    q, k, v, g, beta, _ = inputs(40, seed=6)
    o_ref, S_ref = reference(q, k, v, g, beta)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, S = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16)
    assert S.dtype == torch.float32 and rel_rms(S, S_ref) <= FWD_TOL
    o_b, S_b = chunk_gated_delta_rule(*(x.bfloat16() for x in (q, k, v, g, beta)), chunk_size=16)
    assert o_b.dtype == torch.bfloat16 and S_b.dtype == torch.float32
    # bf16 inputs: each carries a relative rounding of 2^-9 = 2e-3; the output stays within a few
    _, S_b_ref = reference(*(x.bfloat16() for x in (q, k, v, g, beta)))
    assert rel_rms(S_b, S_b_ref) <= FWD_TOL  # exact for the rounded inputs: fp32 inside


def test_the_chunked_form_traces_to_one_static_graph():
    """fullgraph: no graph break (what training.compile needs); aot_eager also runs AOT autograd's
    functionalisation, without inductor's codegen (40 s on a CPU for this graph)."""
    q, k, v, g, beta, _ = inputs(48, seed=7)
    compiled = torch.compile(
        lambda *xs: chunk_gated_delta_rule(*xs, chunk_size=16), fullgraph=True, dynamic=False, backend="aot_eager"
    )
    o_c, S_c = compiled(q, k, v, g, beta)
    o_ref, S_ref = reference(q, k, v, g, beta)
    assert rel_rms(o_c, o_ref) <= FWD_TOL and rel_rms(S_c, S_ref) <= FWD_TOL


def test_the_benchmark_against_gla_runs_as_bench_results_prints_it_and_reports_each_figure():
    """bench/gdn_vs_gla.py, cut to short lengths, with its speed bounds lifted: a test checks the
    report, not a speed (the bounds are the benchmark's, read on a quiet machine)."""
    from project import run_bench

    lengths, contexts = [64, 96], [32, 128]
    report = run_bench(
        "gdn_vs_gla.py",
        *("--lengths", *map(str, lengths), "--decode-contexts", *map(str, contexts)),
        *("--repeats", "1", "--heads", "2", "--head-k-dim", "16", "--head-v-dim", "32"),
        *("--max-ratio", "1e9", "--max-decode-ratio", "1e9"),
        timeout=300,
    )
    assert report["passed"] is True and (report["heads"], report["head_k_dim"], report["head_v_dim"]) == (2, 16, 32)
    for T in map(str, lengths):
        assert report["gdn_s"][T] > 0 and report["gla_s"][T] > 0
        assert report["gdn_over_gla"][T] == report["gdn_s"][T] / report["gla_s"][T]
    steps = report["decode_step_s"]
    assert set(steps) == set(map(str, contexts)) and all(s["gdn"] > 0 and s["gla"] > 0 for s in steps.values())
    assert report["decode_step_ratio"]["gdn"] == steps["128"]["gdn"] / steps["32"]["gdn"]
