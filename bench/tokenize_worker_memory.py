"""The tokenize stage's memory per process: the stage's and each worker's own high-water mark
(VmHWM from /proc, Linux), on corpora bench/tokenize_throughput.py made, with a given tokenizer.

    python bench/tokenize_worker_memory.py --sizes-mb 100 500 1000 --files 4 --record-mb 8

Each size runs in a fresh `python -c` child (2 workers, 32 slices, shards of 12.5M tokens, as
tokenize_throughput.py's laplace side); a thread polls the child and its children every 0.2 s and
keeps each process's VmHWM (the kernel's own peak, not a sample of RSS). The corpora and the
tokenizer are tokenize_throughput.py's (run it first, or point --scratch at its folder).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def vm_hwm(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def children(pid: int) -> list[int]:
    found = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return found


def measure(corpus: Path, tokenizer: Path, out: Path, workers: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    code = (
        "from laplace.config import DataSection, TokenizerSection\n"
        "from laplace.data.tokenize import tokenize_corpus\n"
        f"data = DataSection(source='files', path={str(corpus)!r}, num_proc={workers}, slices=32,"
        " shard_tokens=100_000_000 // 8)\n"
        f"tokenize_corpus(data, TokenizerSection(from_={str(tokenizer)!r}), {str(out)!r}, seed=0)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.DEVNULL)
    peaks: dict[int, int] = {}

    def watch():
        while proc.poll() is None:
            for pid in [proc.pid, *children(proc.pid)]:
                if (found := vm_hwm(pid)) is not None:
                    peaks[pid] = max(peaks.get(pid, 0), found)
            time.sleep(0.2)

    watcher = threading.Thread(target=watch)
    started = time.perf_counter()
    watcher.start()
    proc.wait()
    watcher.join()
    if proc.returncode:
        raise SystemExit(f"tokenize failed on {corpus} with exit status {proc.returncode}")
    stage = peaks.pop(proc.pid, 0)
    # the spawn start method's resource tracker and the pool's helpers are small; the encode
    # workers are the largest children
    kids = sorted(peaks.values(), reverse=True)
    return {
        "seconds": time.perf_counter() - started,
        "stage_vm_hwm_mb": stage / 1e6,
        "worker_vm_hwm_mb": [k / 1e6 for k in kids[:workers]],
        "other_children_vm_hwm_mb": [k / 1e6 for k in kids[workers:]],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mb", type=int, nargs="+", default=[100, 500, 1000])
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--record-mb", type=float, default=8)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--scratch", default="/tmp/laplace-bench-tokenize")
    args = p.parse_args()
    scratch = Path(args.scratch)
    tokenizer = scratch / "tokenizer.json"
    rows = {}
    for size in args.sizes_mb:
        corpus = scratch / f"corpus-{size}mb-{args.files}f-{args.record_mb:g}mb"
        if not corpus.is_dir() or not tokenizer.is_file():
            raise SystemExit(f"{corpus} or {tokenizer} missing: run bench/tokenize_throughput.py at these sizes")
        rows[f"{size}MB"] = measure(corpus, tokenizer, scratch / f"out-memory-{size}mb", args.workers)
        print(size, "MB", json.dumps(rows[f"{size}MB"]), flush=True)
    print(json.dumps({"workers": args.workers, "files": args.files, "record_mb": args.record_mb, "runs": rows}))


if __name__ == "__main__":
    main()
