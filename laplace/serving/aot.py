"""Ahead-of-time compiled serving graphs: one AOTInductor package per decode width and prefill bucket.

Why: a warm start from Inductor's FX graph cache still runs Dynamo's trace of every graph before
the cache is looked up (49-175 s per graph on a loaded machine, 2.1x faster than compiling). A
package (`torch._inductor.aoti_compile_and_package`) is a shared library that
`torch._inductor.aoti_load_package` loads without tracing anything.

Weights and state are not in a package (the graphs depend on shapes, not on weights): it is
built with `aot_inductor.package_constants_in_so` off, and at load every parameter and buffer of
the model runner's StepGraphs is handed over with `load_constants(..., user_managed=True)`, so the
graph reads the live weights and reads and writes the cache manager's state rows in place, as
the torch.compile'd step does.

A package is found by a file name that holds a fingerprint of all it was compiled for: the graph
(kind, size, the shapes and dtypes of its inputs and constants), the model's configuration, the
source of the code traced into it, torch's version and the intra-op thread count. Anything else
finds no package, and that graph is compiled just in time as before: a stale package is never run.

A package is the whole step whatever `engine.compile_scope` says: that knob decides what compiles
just in time where there is no package (one GLA block per shape, or the whole step); the export
runs blocks compiled just in time as plain code.

Packages live in `aoti/` of the compile cache directory (TORCHINDUCTOR_CACHE_DIR, which every
warmup, serve-check, probes and `laplace serve` process points at its copy of the warmup
artifact). CPU only: on CUDA the decode step is CUDA-graphed by torch.compile's reduce-overhead
mode, which a package does not capture; Neuron keeps its NEFF cache.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

PACKAGE_DIR = "aoti"
# the source traced into the graphs: a change there must not load an older package
_TRACED_SOURCES = ("model", "serving/sampling.py", "serving/model_runner.py", "sharding.py")


def package_dir() -> Path | None:
    """Where this process's packages are: `aoti/` of its compile cache directory (None: no cache set)."""
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return Path(cache) / PACKAGE_DIR if cache else None


def applies(device: torch.device, backend: str, compiled: bool) -> bool:
    """Packages serve a compiled engine's graphs with Inductor on CPU (see the module docstring)."""
    return compiled and device.type == "cpu" and backend == "inductor"


@functools.cache  # the source does not change under a running process
def _source_digest() -> str:
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for entry in _TRACED_SOURCES:
        path = root / entry
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            digest.update(file.relative_to(root).as_posix().encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()


class _Graph(nn.Module):
    """One method of the StepGraphs as a module's forward: what torch.export exports."""

    def __init__(self, graphs: nn.Module, method: str):
        super().__init__()
        self.graphs, self.method = graphs, method

    def forward(self, *args: Tensor):
        return getattr(self.graphs, self.method)(*args)


def _constants(graphs: nn.Module) -> dict[str, Tensor]:
    """Every parameter and buffer by the name the exported graph gives it (tied weights under each name)."""
    named = list(graphs.named_parameters(remove_duplicate=False)) + list(graphs.named_buffers(remove_duplicate=False))
    return {f"graphs.{name}": tensor for name, tensor in named}


def fingerprint(graphs: nn.Module, kind: str, size: int, args: tuple[Tensor, ...]) -> str:
    """What a package of this graph was compiled for (see the module docstring), as 16 hex digits."""
    spec = {
        "graph": [kind, size],
        "inputs": [[list(a.shape), str(a.dtype)] for a in args],
        "constants": sorted([name, list(t.shape), str(t.dtype)] for name, t in _constants(graphs).items()),
        # every field of the model's configuration but init_std, which decides weights the package does not hold
        "model": {k: v for k, v in graphs.model.cfg.to_dict().items() if k != "init_std"},
        "source": _source_digest(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:16]


def package_path(directory: Path, kind: str, size: int, key: str) -> Path:
    return Path(directory) / f"{kind}-{size}-{key}.pt2"


def build(graphs: nn.Module, method: str, args: tuple[Tensor, ...], path: Path) -> Path:
    """Export `graphs.<method>` at these inputs and compile it into the package `path` (written
    whole, then moved into place: a killed build leaves no package)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".partial-{os.getpid()}-{path.name}")  # the .pt2 ending is required
    try:
        # force_eager: blocks compiled just in time (compile scope "block") are traced as plain code
        with (
            torch.inference_mode(False),
            torch.no_grad(),
            torch.compiler.set_stance("force_eager"),
            warnings.catch_warnings(),
        ):
            # torch 2.13's own export code trips its pytree deprecation: two lines per graph in every log
            warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
            exported = torch.export.export(_Graph(graphs, method), args, strict=False)
            torch._inductor.aoti_compile_and_package(
                exported,
                package_path=str(partial),
                inductor_configs={"aot_inductor.package_constants_in_so": False},
            )
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def load(graphs: nn.Module, path: Path) -> Callable[..., object]:
    """The package at `path` as a callable over the live weights and state rows of `graphs`."""
    loaded = torch._inductor.aoti_load_package(str(path))
    constants = _constants(graphs)
    wanted = loaded.get_constant_fqns()
    if missing := [name for name in wanted if name not in constants]:
        raise RuntimeError(f"AOTInductor package {path}: constants {missing[:3]} are not the model runner's")
    loaded.load_constants({name: constants[name] for name in wanted}, check_full_update=True, user_managed=True)
    return loaded
