"""`lm_eval --model laplace`, unchanged: the `laplace` model made known to lm-eval's own command line.

lm-eval 0.4 has no plugin discovery for models: its registry holds its own MODEL_MAPPING and what
was registered in the running process. So, as coverage.py and setuptools do for what must happen at
interpreter start, a one-line `.pth` in the environment (written by `install_pth`, which
`make setup` runs) calls `install()`. That adds an import hook and nothing else: when lm-eval's
registry module is first imported, lm-eval's own models are registered (lm_eval.models, as its
get_model would) and then `laplace`, as the lazy "module:Class" placeholder lm-eval's registry
materialises on first use. Startup of any other program pays for importing this file only.

    python -m laplace.evals.lm_eval_plugin    # write the .pth into this interpreter's site-packages
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import sysconfig
from pathlib import Path

from laplace.fileio import atomic_write_bytes

MODEL = "laplace"
TARGET = "laplace.evals.harness:LaplaceHarnessLM"
REGISTRY = "lm_eval.api.registry"
PTH_NAME = "laplace_lm_eval.pth"
# one line (site executes a .pth line that starts with `import`); silent where laplace is gone
PTH_LINE = (
    "import importlib.util; importlib.util.find_spec('laplace') and "
    "__import__('laplace.evals.lm_eval_plugin', fromlist=['install']).install()\n"
)


def register(registry) -> None:
    """Register `laplace` in lm-eval's model registry (the module `lm_eval.api.registry`)."""
    import lm_eval.models  # noqa: F401  lm-eval's own models: get_model loads them only into an empty registry

    if MODEL not in registry.model_registry:
        registry.model_registry.register(MODEL, target=TARGET)


class _AfterRegistry(importlib.abc.MetaPathFinder):
    """Finds lm-eval's registry module as the normal finders do, and registers `laplace` once it has run."""

    def find_spec(self, name, path=None, target=None):
        if name != REGISTRY:
            return None
        sys.meta_path.remove(self)  # one shot, and no recursion into this finder below
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def run_then_register(module):
            run(module)
            register(module)

        spec.loader.exec_module = run_then_register
        return spec


def install() -> None:
    if REGISTRY in sys.modules:
        register(sys.modules[REGISTRY])
    elif not any(isinstance(finder, _AfterRegistry) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterRegistry())


def install_pth(site_packages: Path | None = None) -> Path:
    """Write the .pth into `site_packages` (default: this interpreter's); returns its path."""
    folder = Path(site_packages or sysconfig.get_paths()["purelib"])
    path = folder / PTH_NAME
    atomic_write_bytes(path, PTH_LINE.encode("utf-8"))
    return path


if __name__ == "__main__":
    print(f"lm_eval --model {MODEL}: {install_pth()}")
