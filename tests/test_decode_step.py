"""The decode step as one graph (gpt-fast's shape): the state pool as buffers updated in place,
sampling on the device inside the step, no host synchronisation, per-request seeds that do not
depend on the batch; on CUDA, CUDA graphs against eager."""

import dataclasses

import pytest
import torch
from test_engine import model, staggered
from torch._dynamo.backends.common import aot_autograd
from torch.utils._python_dispatch import TorchDispatchMode

from laplace.config import EngineSection
from laplace.runtime import configure_compiler
from laplace.serving.engine import DecodeEngine
from laplace.serving.replay import replay
from laplace.serving.sampling import stream_key
from laplace.serving.scheduler import Request

SYNC = torch.ops.aten._local_scalar_dense.default  # what .item(), .tolist() and bool(tensor) run


def engine(m, compile_scope=None, max_slots=4, buckets=(16,)):
    shapes = dict(max_slots=max_slots, prefill_buckets=list(buckets), max_prompt_tokens=max(buckets))
    params = dataclasses.replace(
        EngineSection(), **shapes, compile_scope=compile_scope or "block", prefix_cache_bytes=0
    )
    return DecodeEngine(m, params, "padded", compiled=compile_scope is not None)


def step_inputs(eng, width, live=2, temperature=0.8):
    """A step of `live` rows (one greedy, the others sampled, distinct seeds) padded to `width`."""
    pad = width - live
    ints = torch.tensor(
        [
            [5, 9, 11, 13][:live] + [0] * pad,
            list(range(live)) + [eng.cache.pool.dummy] * pad,
            [stream_key(seed, i) for seed, i in ((3, 0), (-7, 4), (2**62, 9), (1, 2))][:live] + [0] * pad,
        ]
    )
    floats = torch.tensor([[0.0] + [temperature] * (live - 1) + [0.0] * pad, [1.0] + [0.9] * (live - 1) + [1.0] * pad])
    return ints, floats


class CountSyncs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.syncs += func is SYNC
        return func(*args, **(kwargs or {}))


@torch.inference_mode()
def test_the_decode_step_is_one_graph_with_no_host_synchronisation():
    """Dynamo captures the whole step (model, state writes, sampler) with fullgraph=True and no
    graph break; its ATen graph has no _local_scalar_dense (.item/.tolist), and neither has an eager step."""
    torch._dynamo.reset()
    eng = engine(model())
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    backend = aot_autograd(fw_compiler=capture)
    step = torch.compile(eng.runner.graphs.decode_step, fullgraph=True, dynamic=False, backend=backend)
    ints, floats = step_inputs(eng, width=4)
    before = eng.cache.state.clone()
    tokens, logits = step(ints, floats)
    assert len(graphs) == 1
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert SYNC not in targets and torch.ops.aten.item.default not in targets
    assert torch._dynamo.utils.counters["graph_break"] == {}
    # the state buffers were written in place: the live rows moved, the unused slots did not
    assert not torch.equal(eng.cache.state.recurrent[:, :2], before.recurrent[:, :2])
    assert torch.equal(eng.cache.state.recurrent[:, 2:4], before.recurrent[:, 2:4])

    eng.cache.state.recurrent.copy_(before.recurrent)
    eng.cache.state.conv.copy_(before.conv)
    with CountSyncs() as counter:
        eager_tokens, eager_logits = eng.runner.graphs.decode_step(ints, floats)
    assert counter.syncs == 0
    torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(tokens, eager_tokens)
    assert tokens[0] == logits[0].argmax()  # the greedy row


def test_a_requests_samples_do_not_depend_on_its_batch():
    """Sampling draws from (request seed, token index, vocabulary index) alone: a seeded request
    gives the same tokens alone and among others, at any width."""
    m = model()
    mine = Request(100, [3, 1, 4, 1, 5], 12, temperature=1.0, top_p=0.9, seed=2**63 + 5)
    alone = replay(engine(m), [mine])[0].output_ids
    others = [Request(i, [7 + i, 2], 9, temperature=0.7, seed=i) for i in range(3)]
    crowd = {c.request_id: c.output_ids for c in replay(engine(m), [*others, mine])}
    assert crowd[100] == alone and len(alone) == 12
    assert len({tuple(crowd[i]) for i in range(3)}) == 3  # different seeds, different draws
    reseeded = Request(100, [3, 1, 4, 1, 5], 12, temperature=1.0, top_p=0.9, seed=6)
    assert replay(engine(m), [reseeded])[0].output_ids != alone


@pytest.mark.slow
@torch.inference_mode()
def test_the_compiled_step_samples_what_the_eager_step_samples():
    """Inductor's whole-step graph (compile_scope=model, no CUDA graphs on the CPU) against eager,
    greedy and sampled rows, through the scheduler at the warmed widths, never recompiling."""
    torch._dynamo.reset()
    m = model()
    compiled, eager = engine(m, "model", max_slots=2), engine(m, None, max_slots=2)
    configure_compiler(compiled.runner.graphs_needed())
    compiled.runner.warmup()
    requests = [
        Request(r.id, r.prompt_ids[:16], r.max_new_tokens, temperature=0.8 * (r.id % 2), top_p=0.9, seed=r.id)
        for r in staggered(6)
    ]
    with torch.compiler.set_stance("fail_on_recompile"):
        done = replay(compiled, requests)
    assert [c.output_ids for c in done] == [c.output_ids for c in replay(eager, requests)]


# --------------------------------------------------------------------------- CUDA graphs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device; run by bench/gpu_check.sh")
@torch.inference_mode()
def test_cuda_graph_decode_equals_eager_over_64_steps_at_every_width():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    m = model().cuda()
    compiled, eager = engine(m, "model", max_slots=4), engine(m, None, max_slots=4)
    assert compiled.runner.cuda_graphs
    configure_compiler(compiled.runner.graphs_needed())
    compiled.runner.warmup()
    compiled.cache.state.recurrent[:, compiled.cache.pool.dummy] = float("nan")  # any leak from a pad row shows
    compiled.cache.state.conv[:, compiled.cache.pool.dummy] = float("nan")
    nan = float("nan")
    for width in compiled.scheduler.ladder:
        for live in sorted({max(1, width // 2), width}):  # with pad rows (where the width pads) and full
            outs = []
            for eng in (compiled, eager):
                eng.reset()
                eng.cache.state.recurrent[:, eng.cache.pool.dummy] = nan  # a pad row leaking into a live one would show
                eng.cache.state.conv[:, eng.cache.pool.dummy] = nan
                with eng.cache.leased(range(live)) as slots, torch.compiler.set_stance("fail_on_recompile"):
                    tokens = [int(eng.runner.prefill(s, [1 + i, 2 + i, 3]).argmax()) for i, s in enumerate(slots)]
                    seen = []
                    for _ in range(64):
                        tokens = eng.runner.decode_rows(slots, tokens, width).argmax(-1).tolist()
                        seen.append(tokens)
                    assert torch.isfinite(eng.cache.state.recurrent[:, slots]).all()
                outs.append(seen)
            assert outs[0] == outs[1], (width, live)
    # and the sampler inside the graph, through the scheduler: greedy and seeded rows
    requests = [
        Request(r.id, r.prompt_ids[:16], r.max_new_tokens, temperature=0.8 * (r.id % 2), top_p=0.9, seed=r.id)
        for r in staggered(8)
    ]
    compiled.reset(), eager.reset()
    with torch.compiler.set_stance("fail_on_recompile"):
        done = replay(compiled, requests)
    assert [c.output_ids for c in done] == [c.output_ids for c in replay(eager, requests)]
    assert counters["inductor"]["cudagraph_skips"] == 0
