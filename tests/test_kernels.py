"""model.kernel: the choice, the custom-op plumbing that lets fla's kernels sit inside a
torch.compile(fullgraph=True) graph (driven on the CPU with the torch form as the op's
implementation), and, on CUDA with flash-linear-attention installed, fla against the torch form."""

import dataclasses

import pytest
import torch
from conftest import rel_rms

from laplace.config import config_from_dict
from laplace.errors import ConfigError
from laplace.model import kernels
from laplace.model.config import preset_model_config
from laplace.model.gla import chunk_gla, gla_step, min_log_decay, naive_gla
from laplace.model.lm import LaplaceLM

SUB = 16
FLOOR = min_log_decay(SUB)  # -10 per token


def gla_inputs(B=2, T=37, H=2, K=16, V=32, lo=-3.0, hi=-0.05, device="cpu", dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=gen) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen)
    g = lo + (hi - lo) * torch.rand(B, T, H, K, generator=gen)
    h0 = torch.randn(B, H, K, V, generator=gen)
    return [x.to(device) for x in (q.to(dtype), k.to(dtype), v.to(dtype), g, h0)]


# --------------------------------------------------------------------------- the choice


def test_the_kernel_resolves_per_device_and_fla_where_it_cannot_run_is_one_line(monkeypatch):
    assert kernels.resolve_kernel("torch", "cpu") == "torch"
    assert kernels.resolve_kernel("auto", "cpu") == "torch"
    assert kernels.resolve_kernel("fla", "cuda", torch.float64) == "torch"  # the fp64 reference is always torch
    monkeypatch.setattr(kernels, "FLA_INSTALLED", False)
    assert kernels.resolve_kernel("auto", "cuda") == "torch"
    with pytest.raises(ConfigError, match=r"^model\.kernel: fla needs flash-linear-attention .*laplace\[cuda\]"):
        kernels.resolve_kernel("fla", "cuda")
    monkeypatch.setattr(kernels, "FLA_INSTALLED", True)
    assert kernels.resolve_kernel("auto", "cuda") == "fla"
    assert kernels.resolve_kernel("auto", "cpu") == "torch"
    with pytest.raises(ConfigError, match=r"^model\.kernel: fla runs on CUDA only, the model is on cpu$"):
        kernels.resolve_kernel("fla", "cpu")
    with pytest.raises(ConfigError, match=r"model\.kernel: must be one of auto, torch, fla"):
        config_from_dict({"model": {"kernel": "triton"}})
    assert config_from_dict({"model": {"kernel": "torch"}}).model_config(vocab_size=300).kernel == "torch"


def test_the_kernel_is_not_part_of_the_architecture():
    cfg = preset_model_config("tiny", vocab_size=300, kernel="torch")
    assert (
        "kernel" not in cfg.architecture()
        and cfg.architecture() == dataclasses.replace(cfg, kernel="fla").architecture()
    )


# --------------------------------------------------------------------------- the custom ops, driven by the torch form


def _direct(q, k, v, g, h0, lengths=None):
    return chunk_gla(q, k, v, g, initial_state=h0, lengths=lengths, chunk_size=16, sub_chunk_size=SUB)


def _through_op(q, k, v, g, h0, lengths=None):
    return kernels.gla_chunk_op(q, k, v, g, h0, lengths, q.shape[-1] ** -0.5, 16, SUB, 2048, "torch")


def _grads(fn, inputs, lengths=None):
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    o, S = fn(*leaves, lengths)
    gen = torch.Generator().manual_seed(1)
    o_w, S_w = (torch.randn(x.shape, generator=gen).to(x.device) for x in (o, S))  # a CUDA run's weights too
    (o * o_w).sum().add((S * S_w).sum()).backward()
    return (o.detach(), S.detach()), [x.grad for x in leaves]


def test_the_chunk_op_runs_the_chosen_implementation_with_its_gradients():
    """Strong decays at the floor, T not a multiple of the chunk, an initial state, right padding."""
    inputs = gla_inputs(T=37, lo=FLOOR, hi=-0.05)
    lengths = torch.tensor([37, 20])
    (o, S), grads = _grads(_through_op, inputs, lengths)
    (o_ref, S_ref), grads_ref = _grads(_direct, inputs, lengths)
    assert rel_rms(o, o_ref) <= 1e-6 and rel_rms(S, S_ref) <= 1e-6
    for name, a, b in zip("q k v g h0".split(), grads, grads_ref):
        assert rel_rms(a, b) <= 1e-6, name
    assert grads[1][1, 20:].abs().max() == 0 and grads[2][1, 20:].abs().max() == 0  # padding is a no-op


def test_the_chunk_op_passes_torch_library_opcheck():
    """Schema, autograd registration, the fake (meta) implementation against the real one, and
    AOT dispatch: what torch.compile relies on."""
    q, k, v, g, h0 = gla_inputs(T=20, lo=FLOOR)
    for x in (q, k, v, g, h0):
        x.requires_grad_(True)
    torch.library.opcheck(kernels.gla_chunk_op, (q, k, v, g, h0, None, 0.25, 16, SUB, 2048, "torch"))
    step = [x[:, 0].detach() for x in (q, k, v, g)]  # decode only: no autograd formula
    torch.library.opcheck(kernels.gla_step_op, (*step, torch.randn(2, 2, 16, 32), 0.25, SUB, "torch"))


def test_the_chunk_op_is_one_opaque_node_in_a_fullgraph_compile():
    """torch.compile(fullgraph=True) through the op: no graph break, the op traced as one node,
    forward and backward equal to the direct form."""
    seen = []

    def count_ops(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def layer(q, k, v, g, h0, lengths):
        o, S = _through_op(q.sin(), k, v, g, h0, lengths)  # something around the op to compile
        return o * 2, S

    compiled = torch.compile(layer, fullgraph=True, dynamic=False, backend=count_ops)
    inputs = gla_inputs(T=40, lo=FLOOR)
    lengths = torch.tensor([40, 33])
    (o, S), grads = _grads(compiled, inputs, lengths)
    (o_ref, S_ref), grads_ref = _grads(
        lambda q, *rest: (lambda o, S: (o * 2, S))(*_direct(q.sin(), *rest)), inputs, lengths
    )
    assert sum("laplace.gla_chunk" in t for t in seen) == 1, seen
    assert rel_rms(o, o_ref) <= 1e-6 and rel_rms(S, S_ref) <= 1e-6
    for name, a, b in zip("q k v g h0".split(), grads, grads_ref):
        assert rel_rms(a, b) <= 1e-6, name
    # and through AOTAutograd (the backward op is opaque too)
    aot = torch.compile(layer, fullgraph=True, dynamic=False, backend="aot_eager")
    (o2, S2), grads2 = _grads(aot, inputs, lengths)
    assert rel_rms(o2, o_ref) <= 1e-6 and all(rel_rms(a, b) <= 1e-6 for a, b in zip(grads2, grads_ref))


def test_the_step_op_equals_the_recurrent_form():
    q, k, v, g, h0 = gla_inputs(T=1, lo=FLOOR)
    o, S = kernels.gla_step_op(q[:, 0], k[:, 0], v[:, 0], g[:, 0], h0, 0.25, SUB, "torch")
    o_ref, S_ref = gla_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], h0, 0.25)
    assert torch.equal(o, o_ref) and torch.equal(S, S_ref)


# --------------------------------------------------------------------------- fla against torch, on CUDA

needs_fla = pytest.mark.skipif(
    not (torch.cuda.is_available() and kernels.FLA_INSTALLED),
    reason="needs a CUDA device and flash-linear-attention (pip install 'laplace[cuda]'); run by bench/gpu_check.sh",
)
# fp32 is compared at 1e-4: tests/conftest.py sets TRITON_F32_DEFAULT=ieee so that Triton's fp32 dots are
# not rounded to TF32 (~1e-3), as it turns TF32 off for torch's matmuls.


def _both(inputs, lengths=None, chunk_size=64):
    def run(kernel):
        def fn(q, k, v, g, h0, lengths):
            return kernels.chunk(
                kernel,
                q,
                k,
                v,
                g,
                initial_state=h0,
                lengths=lengths,
                chunk_size=chunk_size,
                sub_chunk_size=SUB,
                segment_len=2048,
            )

        return _grads(fn, inputs, lengths)

    return run("fla"), run("torch")


@needs_fla
@pytest.mark.parametrize("T", [64, 100, 333])
@pytest.mark.parametrize("decays", ["moderate", "floor"])
def test_fla_and_torch_agree_in_fp32(T, decays):
    lo, hi = (-3.0, -0.05) if decays == "moderate" else (FLOOR, FLOOR / 2)
    inputs = gla_inputs(B=2, T=T, H=6, K=64, V=128, lo=lo, hi=hi, device="cuda")
    ((o, S), grads), ((o_ref, S_ref), grads_ref) = _both(inputs)
    assert rel_rms(o, o_ref) <= 1e-4 and rel_rms(S, S_ref) <= 1e-4
    for name, a, b in zip("q k v g h0".split(), grads, grads_ref):
        # the gate's gradient is a difference of sums that shrinks under strong decays; the torch
        # form itself is within 2e-4 of fp64 there (tests/test_gla.py), so that is the bound
        bound = 5e-4 if name == "g" and decays == "floor" else 1e-4
        assert rel_rms(a, b) <= bound, name


@needs_fla
def test_fla_and_torch_agree_in_bf16_within_the_bf16_gate():
    inputs = gla_inputs(B=2, T=300, H=6, K=64, V=128, lo=-3.0, device="cuda", dtype=torch.bfloat16)
    ((o, S), grads), ((o_ref, S_ref), grads_ref) = _both(inputs)
    assert o.dtype == o_ref.dtype == torch.bfloat16 and S.dtype == S_ref.dtype == torch.float32
    assert rel_rms(o, o_ref) <= 1e-2 and rel_rms(S, S_ref) <= 1e-2  # test_gla's bf16 bound
    for name, a, b in zip("q k v g h0".split(), grads, grads_ref):
        assert rel_rms(a, b) <= 2e-2, name


@needs_fla
def test_fla_padding_is_an_exact_no_op_and_decode_continues_a_prefill():
    q, k, v, g, h0 = gla_inputs(B=2, T=70, H=6, K=64, V=128, lo=FLOOR, device="cuda")
    lengths = torch.tensor([70, 45], device="cuda")
    common = dict(chunk_size=64, sub_chunk_size=SUB, segment_len=2048)
    o, S = kernels.chunk("fla", q, k, v, g, initial_state=h0, lengths=lengths, **common)
    o1, S1 = kernels.chunk(
        "fla", q[1:, :45], k[1:, :45], v[1:, :45], g[1:, :45], initial_state=h0[1:], lengths=None, **common
    )
    assert rel_rms(S[1:], S1) <= 1e-5 and rel_rms(o[1:, :45], o1) <= 1e-5
    # eight decode steps after the prefill, fla's fused recurrent form against the torch step
    S_fla, S_torch = S.clone(), S.clone()
    for t in range(8):
        x = gla_inputs(B=2, T=1, H=6, K=64, V=128, lo=FLOOR, device="cuda", seed=10 + t)
        a, S_fla = kernels.step("fla", x[0][:, 0], x[1][:, 0], x[2][:, 0], x[3][:, 0], S_fla, sub_chunk_size=SUB)
        b, S_torch = kernels.step("torch", x[0][:, 0], x[1][:, 0], x[2][:, 0], x[3][:, 0], S_torch, sub_chunk_size=SUB)
        assert rel_rms(a, b) <= 1e-4 and rel_rms(S_fla, S_torch) <= 1e-4, t
    ref, _ = naive_gla(q[:1].double(), k[:1].double(), v[:1].double(), g[:1].double(), initial_state=h0[:1].double())
    assert rel_rms(o[:1], ref) <= 1e-4


def _fla_model_matches_torch(cfg) -> tuple[LaplaceLM, torch.Tensor, torch.Tensor]:
    """The model on fla's kernels against the same weights on the torch forms: logits and every
    parameter's gradient within 1e-4. Returns (the fla model, its input tokens, the torch logits)."""
    torch.manual_seed(0)
    ref = LaplaceLM(cfg).cuda()
    fla = LaplaceLM(dataclasses.replace(cfg, kernel="fla")).cuda()
    fla.load_state_dict(ref.state_dict())
    tokens = torch.randint(0, cfg.vocab_size, (2, 200), device="cuda")
    outputs = []
    for m in (ref, fla):
        logits = m(tokens)
        logits.float().logsumexp(-1).mean().backward()
        outputs.append(logits.detach())
    assert rel_rms(outputs[1], outputs[0]) <= 1e-4
    for (name, a), (_, b) in zip(fla.named_parameters(), ref.named_parameters()):
        assert rel_rms(a.grad, b.grad) <= 1e-4, name
    return fla, tokens, outputs[0]


@needs_fla
def test_the_model_on_fla_matches_the_torch_kernel_and_compiles_in_one_graph():
    cfg = preset_model_config("tiny", vocab_size=512, n_layers=2, kernel="torch")
    fla, tokens, reference = _fla_model_matches_torch(cfg)
    compiled = torch.compile(fla, fullgraph=True, dynamic=False)
    assert rel_rms(compiled(tokens).detach(), reference) <= 1e-4


# --------------------------------------------------------------------------- Gated DeltaNet: fla against torch, on CUDA


def gdn_inputs(B=2, T=100, H=2, HV=4, K=64, V=128, device="cuda", seed=0):
    """GVA (HV value heads over H key heads), L2-normalised q and k, decays in (-1, 0), beta in (0, 1)."""
    from laplace.model.gated_deltanet import l2_normalize

    gen = torch.Generator().manual_seed(seed)
    q, k = (l2_normalize(torch.randn(B, T, H, K, generator=gen)) for _ in range(2))
    v = torch.randn(B, T, HV, V, generator=gen)
    g, beta = -torch.rand(B, T, HV, generator=gen), torch.rand(B, T, HV, generator=gen)
    h0 = torch.randn(B, HV, K, V, generator=gen)
    return [x.to(device) for x in (q, k, v, g, beta, h0)]


@needs_fla
@pytest.mark.parametrize("T", [64, 100, 333])
def test_fla_and_torch_agree_on_the_gated_delta_rule_in_fp32(T):
    """fla's chunked Triton kernel behind kernels.gdn_chunk against the plain WY/UT form: outputs,
    final state and every gradient (q, k, v, g, beta, initial state), right padding included, at the
    GLA kernels' fp32 bound (1e-4; Triton's fp32 dots are IEEE here, tests/conftest.py)."""
    inputs = gdn_inputs(T=T)
    lengths = torch.tensor([T, T // 2 + 1], device="cuda")

    def run(kernel):
        def fn(q, k, v, g, beta, h0, lengths):
            return kernels.gdn_chunk(
                kernel, q, k, v, g, beta, initial_state=h0, lengths=lengths, chunk_size=64, segment_len=2048
            )

        return _grads(fn, inputs, lengths)

    ((o, S), grads), ((o_ref, S_ref), grads_ref) = run("fla"), run("torch")
    assert rel_rms(o, o_ref) <= 1e-4 and rel_rms(S, S_ref) <= 1e-4
    for name, a, b in zip(("q", "k", "v", "g", "beta", "h0"), grads, grads_ref):
        assert rel_rms(a, b) <= 1e-4, name
    # eight decode steps after the prefill: fla's fused recurrent kernel against the torch step
    S_fla, S_torch = S.clone(), S.clone()
    for t in range(8):
        q, k, v, g, beta, _ = gdn_inputs(T=1, seed=10 + t)
        a, S_fla = kernels.gdn_step("fla", q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], S_fla)
        b, S_torch = kernels.gdn_step("torch", q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], S_torch)
        assert rel_rms(a, b) <= 1e-4 and rel_rms(S_fla, S_torch) <= 1e-4, t


@needs_fla
def test_a_gated_deltanet_model_on_fla_matches_the_torch_kernel():
    _fla_model_matches_torch(preset_model_config("tiny-gdn", vocab_size=512, kernel="torch"))  # 4 GDN layers
