"""The language model: forward, prefill + decode, padding, state accounting, preset figures."""

import pytest
import torch
from conftest import rel_rms

from laplace.model.config import preset_model_config
from laplace.model.lm import LaplaceLM, State, analytic_state_bytes, kv_cache_bytes


def small_model(device="cpu", **over):
    cfg = preset_model_config(
        "tiny", vocab_size=300, d_model=64, n_layers=2, n_heads=2, chunk_size=16, sub_chunk_size=8, **over
    )
    torch.manual_seed(0)
    return LaplaceLM(cfg).to(device).eval()


@pytest.mark.parametrize("conv", [True, False])
def test_prefill_then_decode_reproduces_forward(conv, device):
    model = small_model(device, use_short_conv=conv)
    tokens = torch.randint(0, 300, (3, 53), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        full = model(tokens)
        state = model.allocate_state(3)
        first = model.prefill(tokens[:, :21], state)
        steps = [model.decode_step(tokens[:, t], state) for t in range(21, 53)]
    assert rel_rms(first, full[:, 20]) <= 1e-5
    assert rel_rms(torch.stack(steps, 1), full[:, 21:]) <= 1e-5


def test_padded_prefill_equals_each_row_alone(device):
    model = small_model(device)
    tokens = torch.randint(0, 300, (3, 40), generator=torch.Generator().manual_seed(2)).to(device)
    lengths = torch.tensor([40, 17, 3], device=device)
    with torch.no_grad():
        state = model.allocate_state(3)
        last = model.prefill(tokens, state, lengths=lengths)
        for row, n in enumerate(lengths.tolist()):
            alone = model.allocate_state(1)
            last_alone = model.prefill(tokens[row : row + 1, :n], alone)
            assert rel_rms(last[row], last_alone[0]) <= 1e-5
            assert rel_rms(state.recurrent[:, row], alone.recurrent[:, 0]) <= 1e-5
            # equal up to GEMM rounding (the batch shape changes the kernels)
            assert rel_rms(state.conv[:, row], alone.conv[:, 0]) <= 1e-5


def test_slots_read_and_write_only_their_rows(device):
    model = small_model(device)
    tokens = torch.randint(0, 300, (2, 10), generator=torch.Generator().manual_seed(3)).to(device)
    pool = model.allocate_state(6)
    pool.recurrent.fill_(7.0)
    slots = torch.tensor([4, 1], device=device)
    before = pool.clone()
    with torch.no_grad():
        pool.zero_(slots)
        model.prefill(tokens, pool, slots=slots)
        model.decode_step(tokens[:, 0], pool, slots=slots)
    untouched = torch.tensor([0, 2, 3, 5], device=device)
    assert torch.equal(pool.recurrent[:, untouched], before.recurrent[:, untouched])
    assert not torch.equal(pool.recurrent[:, slots], before.recurrent[:, slots])
    # the same rows computed in a private state agree
    alone = model.allocate_state(2)
    with torch.no_grad():
        model.prefill(tokens, alone)
        model.decode_step(tokens[:, 0], alone)
    assert torch.equal(pool.recurrent[:, slots], alone.recurrent)


@pytest.mark.parametrize(
    "preset,over",
    [
        ("tiny", {}),
        ("tiny", {"use_short_conv": False}),
        ("small", {}),
        ("laplace-3b", {}),
        ("tiny", {"n_heads": 8, "expand_k": 1.0}),
        ("tiny", {"dtype": "bfloat16", "conv_size": 3}),
    ],
)
def test_state_bytes_measured_equals_analytic(preset, over):
    cfg = preset_model_config(preset, vocab_size=None if preset == "laplace-3b" else 1000, **over)
    state = State.allocate(cfg, batch=3, device="meta")
    assert state.nbytes == 3 * analytic_state_bytes(cfg)
    assert state.bytes_per_sequence == analytic_state_bytes(cfg)


def test_laplace_3b_reproduces_the_article_figures():
    from laplace.config import Config
    from laplace.pipeline.cli import model_facts

    facts = model_facts("laplace-3b", Config())
    assert abs(facts["params"] / 3.028e9 - 1) <= 0.01
    assert abs(facts["state_bytes_per_sequence"] / 29.5e6 - 1) <= 0.03
    assert facts["kv_cache_bytes_8192"] == 2 * 24 * 8192 * 3072 * 2
    assert abs(facts["state_vs_kv_8192"] / 82 - 1) <= 0.05
    # and they come from the modules: counting by hand gives the same number
    cfg = preset_model_config("laplace-3b")
    per_layer = (
        2 * 3072 * 1536
        + 3 * 3072 * 3072
        + 3072 * 16
        + 16 * 1536
        + 1536
        + 192
        + 4 * (1536 * 2 + 3072)
        + 3 * 3072 * 8192
        + 2 * 3072
    )
    assert facts["params"] == 24 * per_layer + 3072 + 2 * 50304 * 3072
    assert kv_cache_bytes(cfg, 8192) == facts["kv_cache_bytes_8192"]


def test_tiny_has_5_540_864_parameters():
    """The README's 5.5M parameters (at the default 4,096-token vocabulary), exactly: the
    embedding and the untied head 4096 x 256 each, four blocks of 860,864, the final norm."""
    with torch.device("meta"):
        model = LaplaceLM(preset_model_config("tiny", vocab_size=4096))
    per_block = {sum(p.numel() for p in block.parameters()) for block in model.blocks}
    assert per_block == {860_864}
    assert model.num_parameters() == 5_540_864 == 2 * 4096 * 256 + 4 * 860_864 + 256


def test_model_forward_compiles_to_one_graph(device):
    model = small_model(device)
    tokens = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(4)).to(device)
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    with torch.no_grad():
        assert rel_rms(compiled(tokens), model(tokens)) <= 1e-5
