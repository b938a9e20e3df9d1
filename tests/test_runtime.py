"""Runtime selection: devices, the neuron path's clear errors, and recompiles that never fall back."""

import pytest
import torch

from laplace.runtime import (
    RuntimeErrorConfig,
    compile_static,
    compiled_graph_count,
    configure_compiler,
    neuron_available,
    resolve_device,
)


def test_devices():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(RuntimeErrorConfig, match="unknown device 'tpu'"):
        resolve_device("tpu")


@pytest.mark.skipif(neuron_available(), reason="torch-neuronx is installed here")
def test_neuron_without_the_extra_is_a_one_line_error():
    with pytest.raises(RuntimeErrorConfig) as err:
        resolve_device("neuron")
    assert "torch-neuronx is not installed" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(RuntimeErrorConfig, match="needs torch-neuronx"):
        compile_static(lambda x: x + 1, backend="neuron")


def test_hitting_the_recompile_limit_is_an_error_not_a_silent_eager_fallback():
    torch._dynamo.reset()
    configure_compiler(2)
    limit = torch._dynamo.config.recompile_limit
    assert limit >= 8 and torch._dynamo.config.fail_on_recompile_limit_hit
    # the limit is Dynamo's (one guard failure per new static shape), whatever the backend: Inductor's
    # C++ kernels for 9 shapes would cost ~40 s here and prove nothing more
    fn = compile_static(lambda x: (x * 2).sum(), backend="eager")
    before = compiled_graph_count()
    for n in range(1, limit + 1):
        fn(torch.ones(n))
    assert compiled_graph_count() - before == limit  # one graph per static shape
    with pytest.raises(Exception, match="fail_on_recompile_limit_hit"):
        fn(torch.ones(limit + 1))
    torch._dynamo.reset()
