"""Where and how the model runs: device selection and determinism switches."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys

import torch

from laplace.errors import InputError


class RuntimeErrorConfig(InputError):
    """A runtime choice this machine cannot honour (one-line message)."""


def neuron_available() -> bool:
    return importlib.util.find_spec("torch_neuronx") is not None


def resolve_device(name: str) -> torch.device:
    """`auto|cpu|cuda|neuron` -> a torch.device; `auto` asks torch.accelerator."""
    if name == "auto":
        if torch.accelerator.is_available():
            return torch.accelerator.current_accelerator()
        return torch.device("cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeErrorConfig("device 'cuda' requested but torch.cuda.is_available() is False")
        return torch.device("cuda")
    if name == "neuron":
        if not neuron_available():
            raise RuntimeErrorConfig(
                "device 'neuron' requested but torch-neuronx is not installed "
                "(pip install 'laplace[neuron]' on Trainium)"
            )
        import torch_neuronx  # noqa: F401  (registers the neuron device)

        return torch.device("neuron")
    raise RuntimeErrorConfig(f"unknown device {name!r} (auto, cpu, cuda or neuron)")


def set_determinism(seed: int, deterministic: bool = True) -> None:
    """Fixed seeds and deterministic kernels, for bitwise-reproducible eager runs."""
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=False)


def keep_cpu_allocations() -> bool:
    """Ask glibc malloc to keep freed tensor memory in the process instead of unmapping it.

    Autograd frees and re-allocates the same large activations every step; by default
    glibc returns each to the kernel and page-faults it back in, which made an 8,192-token
    GLA forward+backward 10-15% slower (bench/RESULTS.md). Memory stays at its peak.
    Returns False where malloc is not glibc's (macOS, musl): nothing changes there.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    return bool(
        libc.mallopt(m_mmap_threshold, 32 << 20)  # the largest glibc accepts
        and libc.mallopt(m_trim_threshold, 1 << 30)
        and libc.mallopt(m_top_pad, 64 << 20)
    )


# --------------------------------------------------------------------------- compilation


def set_threads(threads: int) -> None:
    """Intra-op threads for this process (0 keeps torch's default, one per core)."""
    if threads > 0:
        torch.set_num_threads(threads)


def compile_backend(device: torch.device) -> str:
    """Inductor on CPU/CUDA, the Neuron backend on Trainium."""
    return "neuron" if device.type == "neuron" else "inductor"


def configure_compiler(max_graphs_per_function: int) -> None:
    """Static-shape compilation that never silently falls back to eager: the recompile limit is
    raised above the number of shapes we compile, and hitting it is an error."""
    import torch._dynamo.config as dynamo

    limit = max(8, max_graphs_per_function + 2)
    dynamo.recompile_limit = max(dynamo.recompile_limit, limit)
    dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 4 * limit)
    dynamo.fail_on_recompile_limit_hit = True


def compile_static(fn, backend: str = "inductor", mode: str | None = None):
    """torch.compile with one static graph per input shape (what Neuron requires). A module is
    compiled in place (and returned): every instance of its class shares the compiled graphs.
    `mode`: Inductor's, e.g. "reduce-overhead" (CUDA graphs) for the GPU decode step."""
    if backend == "neuron" and not neuron_available():
        raise RuntimeErrorConfig("compile backend 'neuron' needs torch-neuronx (pip install 'laplace[neuron]')")
    options = dict(fullgraph=True, dynamic=False, backend=backend, **({"mode": mode} if mode else {}))
    if isinstance(fn, torch.nn.Module):
        fn.compile(**options)
        return fn
    return torch.compile(fn, **options)


def compiled_graph_count() -> int:
    """Graphs Dynamo has compiled in this process so far (a compile event moves it)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compile_cache_counts() -> tuple[int, int]:
    """(hits, misses) of Inductor's FX graph cache in this process: a hit is a graph loaded from
    the compile cache directory, a miss one compiled from scratch."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["fxgraph_cache_hit"]), int(counters["inductor"]["fxgraph_cache_miss"])


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so wall-clock timings mean something on accelerators."""
    if device.type != "cpu" and torch.accelerator.is_available():
        torch.accelerator.synchronize()
