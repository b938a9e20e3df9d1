"""Shared by the benchmarks: timing, the machine's measured matmul peak, the report format."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from datetime import date

import torch


def median_seconds(fn, repeats: int, warmup: int = 1) -> float:
    """Median wall time of `fn()` over `repeats` runs after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_peak_gflops(n: int = 2048, repeats: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """This machine's fp32 matmul rate, measured now: the ceiling every MFU here is a fraction of."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    seconds = median_seconds(lambda: a @ b, repeats, warmup=2)
    return 2 * n**3 / seconds / 1e9


def machine() -> dict:
    return {
        "date": date.today().isoformat(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def print_table(headers: list[str], rows: list[list]) -> None:
    cells = [[f"{c:.4g}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    for row in cells:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))


def emit(result: dict) -> None:
    """The benchmark's one JSON object, on its own last line."""
    print(json.dumps(result, sort_keys=True))
