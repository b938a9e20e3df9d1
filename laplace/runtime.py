"""Where and how the model runs: device selection and determinism switches."""

from __future__ import annotations

import importlib.util
import os

import torch


class RuntimeErrorConfig(ValueError):
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
                "device 'neuron' requested but torch-neuronx is not installed (pip install 'laplace[neuron]' on Trainium)"
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
