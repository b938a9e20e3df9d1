"""Our Muon equals torch.optim.Muon bit for bit; parameter routing is a partition."""

import pytest
import torch

from laplace.config import AdamWSection, MuonSection
from laplace.model.config import preset_model_config
from laplace.model.lm import LaplaceLM
from laplace.optim.muon import Muon, MuonAdamW, route_parameters, zeropower_via_newtonschulz


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust", [None, "original", "match_rms_adamw"])
def test_muon_equals_torch_muon_bitwise(nesterov, adjust, device):
    gen = torch.Generator().manual_seed(0)
    shapes = [(64, 32), (16, 80), (48, 48)]
    init = [torch.randn(s, generator=gen).to(device) for s in shapes]
    ours = [p.clone().requires_grad_() for p in init]
    ref = [p.clone().requires_grad_() for p in init]
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust)
    opt_ours, opt_ref = Muon(ours, **kw), torch.optim.Muon(ref, **kw)
    for _ in range(6):
        for a, b in zip(ours, ref):
            g = torch.randn(a.shape, generator=gen).to(device)
            a.grad, b.grad = g.clone(), g.clone()
        opt_ours.step()
        opt_ref.step()
    for a, b, p0 in zip(ours, ref, init):
        assert torch.equal(a, b)
        assert not torch.equal(a, p0)  # it did move
    for a, b in zip(ours, ref):
        assert torch.equal(opt_ours.state[a]["momentum_buffer"], opt_ref.state[b]["momentum_buffer"])


def test_newton_schulz_orthogonalises():
    g = torch.randn(64, 32, generator=torch.Generator().manual_seed(3))
    o = zeropower_via_newtonschulz(g, (3.4445, -4.7750, 2.0315), 5, 1e-7).float()
    s = torch.linalg.svdvals(o)
    assert s.min() > 0.5 and s.max() < 1.3  # the quintic lands singular values in ~[0.7, 1.2]


def test_routing_puts_every_parameter_in_exactly_one_group():
    model = LaplaceLM(preset_model_config("tiny", vocab_size=500))
    groups = route_parameters(model)
    names = [n for members in groups.values() for n, _ in members]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    assert len(names) == len(set(names))
    assert all(p.ndim == 2 and n.startswith("blocks.") for n, p in groups["muon"])
    assert {n for n, _ in groups["adamw_decay"]} == {"embed.weight", "lm_head.weight"}
    assert all(p.ndim != 2 or "conv" in n for n, p in groups["adamw_no_decay"])
    muon_names = {n for n, _ in groups["muon"]}
    assert "blocks.0.attn.q_proj.weight" in muon_names and "blocks.0.mlp.down_proj.weight" in muon_names


def test_muon_adamw_state_round_trip():
    torch.manual_seed(0)
    model = LaplaceLM(preset_model_config("tiny", vocab_size=300, d_model=64, n_layers=1, n_heads=2))
    opt = MuonAdamW(model, 1e-3, AdamWSection(), MuonSection())
    x = torch.randint(0, 300, (2, 16))
    model(x).sum().backward()
    opt.step()
    saved = {k: v.clone() for k, v in opt.state_tensors().items()}
    model2 = LaplaceLM(model.cfg)
    model2.load_state_dict(model.state_dict())
    opt2 = MuonAdamW(model2, 1e-3, AdamWSection(), MuonSection())
    opt2.load_state_tensors(saved)
    for m in (model, model2):
        m.zero_grad()
        m(x).sum().backward()
    opt.step()
    opt2.step()
    for (n, a), (_, b) in zip(model.named_parameters(), model2.named_parameters()):
        assert torch.equal(a, b), n
