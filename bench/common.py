"""Shared by the benchmarks: timing, the machine's measured matmul peak, the report format."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from datetime import date

import torch


def add_device_argument(ap) -> None:
    ap.add_argument("--device", default="cpu", help="cpu, or cuda where a GPU is present")


def parse_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {name}: no CUDA device is available here")
    if device.type == "cuda":  # fp32 means fp32: no TF32 in the matmuls or convolutions
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return device


def prepare_device(name: str, keep_allocations: bool = True) -> tuple[torch.device, bool]:
    """The benchmark's device, and whether freed memory stays in the process (CPU only, as in
    training: `laplace.runtime.keep_cpu_allocations`)."""
    from laplace.runtime import keep_cpu_allocations

    device = parse_device(name)
    kept = keep_cpu_allocations() if keep_allocations and device.type == "cpu" else False
    return device, kept


def synchronize(device: torch.device | str = "cpu") -> None:
    """Wait for queued device work: GPU kernels run asynchronously, so timers must wait."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn, repeats: int, warmup: int = 1, device: torch.device | str = "cpu") -> float:
    """Median wall time of `fn()` over `repeats` runs after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_peak_gflops(
    n: int = 2048, repeats: int = 5, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> float:
    """This machine's fp32 matmul rate, measured now: the ceiling every MFU here is a fraction of."""
    if torch.device(device).type == "cuda":
        n = max(n, 8192)  # a 2048 product does not fill a GPU
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    seconds = median_seconds(lambda: a @ b, repeats, warmup=2, device=device)
    return 2 * n**3 / seconds / 1e9


def machine(device: torch.device | str = "cpu") -> dict:
    info = {
        "date": date.today().isoformat(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "device": str(device),
    }
    if torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def print_table(headers: list[str], rows: list[list]) -> None:
    cells = [[f"{c:.4g}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    for row in cells:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))


def emit(result: dict) -> None:
    """The benchmark's one JSON object, on its own last line."""
    print(json.dumps(result, sort_keys=True))
