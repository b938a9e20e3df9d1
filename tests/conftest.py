import os

import pytest
import torch

from project import TINY_MODEL

# Tests run on 2 cores; keep torch from oversubscribing when pytest itself is the only job.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
# fp32 tests compare at 1e-5: TF32 (cuDNN's default for convolutions on CUDA) would give ~1e-3.
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
# ... and Triton's fp32 dots (flash-linear-attention's kernels) likewise; read when a kernel compiles.
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

# Numerical tests that take `device` run on the CPU everywhere and on CUDA where a GPU is present.
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
]


def rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative RMS error ||a - e|| / ||e||, computed in fp64."""
    a, e = actual.double(), expected.double()
    return ((a - e).pow(2).mean().sqrt() / e.pow(2).mean().sqrt().clamp(min=1e-30)).item()


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)


@pytest.fixture
def seeded():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def tiny_artifacts(tmp_path_factory):
    """A tokenized corpus and an exported, briefly trained 1-layer model: (data_dir, export_dir)."""
    from laplace.config import config_from_dict
    from laplace.data.tokenize import tokenize_corpus
    from laplace.model.export import export_model
    from laplace.training import checkpoint as ckpt
    from laplace.training.loop import train

    root = tmp_path_factory.mktemp("tiny-artifacts")
    cfg = config_from_dict(
        {
            "data": {"max_documents": 300, "num_proc": 1},
            "tokenizer": {"vocab_size": 400},
            "model": {"preset": "tiny", **TINY_MODEL},
            "train": {
                "steps": 20,
                "batch_size": 4,
                "seq_len": 32,
                "eval_every": 20,
                "eval_batches": 1,
                "checkpoint_every": 20,
                "warmup_steps": 2,
            },
        }
    )
    data_dir, export_dir = root / "tokenized", root / "export"
    tokenize_corpus(cfg.data, cfg.tokenizer, data_dir, cfg.seed)
    result = train(cfg, data_dir, root / "run", progress=False)
    export_model(ckpt.load_checkpoint(result.checkpoint), data_dir / "tokenizer.json", export_dir)
    return data_dir, export_dir
