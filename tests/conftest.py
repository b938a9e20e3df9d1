import os

import pytest
import torch

# Tests run on 2 cores; keep torch from oversubscribing when pytest itself is the only job.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative RMS error ||a - e|| / ||e||, computed in fp64."""
    a, e = actual.double(), expected.double()
    return ((a - e).pow(2).mean().sqrt() / e.pow(2).mean().sqrt().clamp(min=1e-30)).item()


@pytest.fixture
def seeded():
    torch.manual_seed(0)
    yield
