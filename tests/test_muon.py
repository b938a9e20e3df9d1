"""The sharded optimizer's Muon equals torch.optim.Muon bit for bit; the exchange plan keeps every
split even; parameter routing is a partition."""

import pytest
import torch

from laplace.model.config import preset_model_config
from laplace.model.lm import LaplaceLM
from laplace.optim.muon import route_parameters, zeropower_via_newtonschulz
from laplace.optim.sharded import ExchangePlan, ShardedMuon, muon_traffic


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust", [None, "original", "match_rms_adamw"])
def test_sharded_muon_on_whole_matrices_equals_torch_muon_bitwise(nesterov, adjust, device):
    """On one process (plain tensors) ShardedMuon runs its pieces on whole matrices; the
    multi-rank runs are checked against torch.optim.Muon in tests/test_distributed.py."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(64, 32), (16, 80), (48, 48)]
    init = [torch.randn(s, generator=gen).to(device) for s in shapes]
    ours = [p.clone().requires_grad_() for p in init]
    ref = [p.clone().requires_grad_() for p in init]
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust)
    opt_ours, opt_ref = ShardedMuon(ours, **kw), torch.optim.Muon(ref, **kw)
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


def test_exchange_plan_batches_shapes_with_even_splits():
    shapes = [(10, 4), (6, 6), (10, 4), (10, 4), (6, 6), (3, 5)]
    plan = ExchangePlan(shapes, world=2)
    # matrices of one shape in batches of W; every rank pads its row shard to ceil(rows / W)
    assert [(b.shape, b.members, b.rows) for b in plan.batches] == [
        ((10, 4), (0, 2), 5),
        ((10, 4), (3,), 5),
        ((6, 6), (1, 4), 3),
        ((3, 5), (5,), 2),
    ]
    assert [b.offset for b in plan.batches] == [0, 20, 40, 58] and plan.segment == 68
    assert plan.padding_slots == 2
    # owners rotate after a partial batch: the leftover (10, 4) goes to rank 0, the (3, 5) to rank 1
    assert [b.owners for b in plan.batches] == [(0, 1), (0,), (1, 0), (1,)]
    assert sorted(m for r in range(2) for _, m in plan.owned_by(r)) == list(range(6))
    # analytic traffic: two all-to-alls, each rank sends 68 values to the other and receives 68, bf16
    t = muon_traffic(shapes, world=2)
    assert t["alltoall_bytes_per_rank"] == 2 * 2 * 68 * 2
    # all-gather: each rank sends its padded shards (5+3+5+5+3+2 rows) to the other and receives theirs
    assert t["allgather_bytes_per_rank"] == 2 * (5 * 4 * 3 + 3 * 6 * 2 + 2 * 5) * 2
    assert muon_traffic(shapes, world=1)["alltoall_bytes_per_rank"] == 0
