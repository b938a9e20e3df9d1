"""Tokenization throughput and memory: laplace's streaming sharded pipeline vs nanoGPT's FineWeb
approach, side by side on the same text, the same tokenizer and the same number of processes.

    python bench/tokenize_throughput.py --sizes-mb 100 500 1000 --workers 2
    python bench/tokenize_throughput.py --sizes-mb 100 500 1000 --workers 2 --files 4 --record-mb 8
    python bench/tokenize_throughput.py --sizes-mb 50 --sides laplace laplace-dask --dask-workers 1 2

`laplace-dask`: the same stage with data.executor: dask on a LocalCluster of 1 and 2 workers
(scheduler, nannies and workers all children of the run, so their CPU-seconds are counted);
each run reports wall seconds, CPU-seconds of its whole process tree (getrusage of the reaped
children), tokens per CPU-second, peak RSS (tree, parent, largest child) and the peak bytes of
its staging directory plus output on disk.

The text is JSON Lines files of real English (the python-docs corpus, each copy of a document
numbered so none repeats exactly) until each size is reached. `--files 4 --record-mb 8`: few
files of large records (each record the documents joined up to about 8 MB, so one file holds a
quarter of the corpus), the corpus that used to serialise laplace on one worker per file and
set its memory by the largest record. Both sides use one tokenizer.json
(trained once, not timed) and `workers` processes:

* laplace: `tokenize_corpus` (survey + encode passes, fixed-size shards, manifests).
* nanoGPT: the structure of its fineweb.py: a multiprocessing Pool encodes documents
  (`imap(..., chunksize=16)`), the main process fills a preallocated uint16 buffer of
  shard_size tokens and writes each full shard.

Peak RSS is the largest sum over the whole process tree (sampled every 0.1 s with psutil), and
each process's own peak: the parent's (laplace: the stage process) and the largest child's (the
encode workers). `--sides laplace` runs laplace alone (a memory check across sizes).
Results go to bench/results/tokenize.json; figures are copied by hand into bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]


def make_corpus(directory: Path, size_bytes: int, files: int = 32, record_bytes: int = 0) -> int:
    from laplace.data.pydocs import python_docs_documents

    docs = python_docs_documents()
    directory.mkdir(parents=True, exist_ok=True)
    handles = [open(directory / f"part-{i:03d}.jsonl", "w", encoding="utf-8") for i in range(files)]
    written, n, records = 0, 0, 0
    while written < size_bytes:
        parts, size = [], 0
        while size < max(record_bytes, 1) and written + size < size_bytes:
            text = f"Copy {n // len(docs)}. " + docs[n % len(docs)]
            parts.append(text)
            size += len(text.encode("utf-8"))
            n += 1
        handles[records % files].write(json.dumps({"text": "\n\n".join(parts)}) + "\n")
        written += size
        records += 1
    for h in handles:
        h.close()
    return n


def tree_peak_rss(proc: subprocess.Popen) -> tuple[int, float, dict[int, int]]:
    """(the largest sum of RSS over the tree, seconds, each process's own peak RSS by pid)."""
    peak, each = 0, {}
    root = psutil.Process(proc.pid)
    start = time.perf_counter()
    while proc.poll() is None:
        try:
            sizes = {p.pid: p.memory_info().rss for p in [root, *root.children(recursive=True)]}
        except psutil.Error:
            sizes = {}
        for pid, rss in sizes.items():
            each[pid] = max(each.get(pid, 0), rss)
        peak = max(peak, sum(sizes.values()))
        time.sleep(0.1)
    return peak, time.perf_counter() - start, each


# --------------------------------------------------------------------------- one measured run


def dir_bytes(*directories: Path) -> int:
    """Bytes on disk under the directories, each inode once (the assembly hard-links the staged shards)."""
    seen: dict[tuple[int, int], int] = {}
    for directory in directories:
        for root, _, files in os.walk(directory):
            for name in files:
                try:
                    st = os.lstat(os.path.join(root, name))
                except OSError:
                    continue
                seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


def run_one(which: str, corpus: Path, tokenizer_path: str, out: Path, workers: int) -> dict:
    code = (
        "import json, sys, os\n"
        "sys.path.append(os.path.join(os.environ['BENCH_ROOT'], 'bench'))\n"
        "from tokenize_nanogpt import SHARD_TOKENS, nanogpt_style\n"
        "from pathlib import Path\n"
        f"which, corpus, tok, out, workers = {which!r}, Path({str(corpus)!r}), {tokenizer_path!r}, "
        f"Path({str(out)!r}), {workers}\n"
        "if which.startswith('laplace'):\n"
        "    from laplace.config import DataSection, TokenizerSection\n"
        "    from laplace.data.tokenize import tokenize_corpus\n"
        "    executor = 'dask' if which == 'laplace-dask' else 'local'\n"
        "    data = DataSection(source='files', path=str(corpus), num_proc=workers, slices=32,\n"
        "                       shard_tokens=SHARD_TOKENS, executor=executor)\n"
        "    m = tokenize_corpus(data, TokenizerSection(from_=tok), out, seed=0)\n"
        "    tokens = m['tokens_train'] + m['tokens_val']\n"
        "else:\n"
        "    tokens = nanogpt_style(corpus, tok, out, workers)\n"
        "print(json.dumps({'tokens': tokens}))\n"
    )
    env = {**os.environ, "BENCH_ROOT": str(ROOT), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    peak = [(0, 0.0, {})]
    disk = [0]
    watcher = threading.Thread(target=lambda: peak.__setitem__(0, tree_peak_rss(proc)))
    watcher.start()

    def watch_disk() -> None:  # the staging directory and the output, what the run holds on disk
        while proc.poll() is None:
            disk[0] = max(
                disk[0], dir_bytes(out.parent / f".{out.name}.partial", out, out.parent / f".{out.name}.next")
            )
            time.sleep(0.5)

    disk_watcher = threading.Thread(target=watch_disk)
    disk_watcher.start()
    stdout, _ = proc.communicate()
    watcher.join()
    disk_watcher.join()
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # every process of the tree, once reaped
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode:
        raise SystemExit(f"{which} failed with exit status {proc.returncode}")
    tokens = json.loads(stdout.decode().strip().splitlines()[-1])["tokens"]
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "tokens_per_s_per_core": tokens / seconds / workers,
        "cpu_seconds": cpu_s,
        "tokens_per_cpu_s": tokens / max(cpu_s, 1e-9),
        "peak_disk_mb": disk[0] / 1e6,
        "peak_rss_mb": peak[0][0] / 1e6,
        # the parent (laplace: the stage) and the largest of its children (the encode workers)
        "parent_peak_rss_mb": peak[0][2].get(proc.pid, 0) / 1e6,
        "child_peak_rss_mb": max((v for k, v in peak[0][2].items() if k != proc.pid), default=0) / 1e6,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mb", type=int, nargs="+", default=[100, 500, 1000])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--files", type=int, default=32, help="JSON Lines files the corpus is spread over")
    p.add_argument("--record-mb", type=float, default=0, help="join documents into records of about this size")
    p.add_argument("--scratch", default="/tmp/laplace-bench-tokenize")
    p.add_argument(
        "--sides",
        nargs="+",
        default=["laplace", "nanogpt"],
        choices=["laplace", "laplace-dask", "nanogpt"],
        help="what to run (laplace-dask: data.executor dask on a LocalCluster of --workers)",
    )
    p.add_argument("--dask-workers", type=int, nargs="+", default=None, help="laplace-dask with each of these")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "tokenize.json"))
    args = p.parse_args()
    scratch = Path(args.scratch)
    scratch.mkdir(parents=True, exist_ok=True)

    tokenizer_path = scratch / "tokenizer.json"
    if not tokenizer_path.exists():
        from laplace.data.pydocs import python_docs_documents
        from laplace.data.tokenizer import train_tokenizer

        train_tokenizer(python_docs_documents(), 4096, 2).save(str(tokenizer_path))

    results = {
        "workers": args.workers,
        "cpu": os.cpu_count(),
        "files": args.files,
        "record_mb": args.record_mb,
        "load_average_at_start": os.getloadavg(),
        "runs": {},
    }
    for size in args.sizes_mb:
        corpus = scratch / f"corpus-{size}mb-{args.files}f-{args.record_mb:g}mb"
        if not corpus.exists():
            make_corpus(corpus, size * 1_000_000, args.files, int(args.record_mb * 1_000_000))
        row = {}
        sides = [(w, args.workers) for w in args.sides if w != "laplace-dask"]
        if "laplace-dask" in args.sides:
            sides += [("laplace-dask", n) for n in args.dask_workers or [args.workers]]
        for which, workers in sides:
            name = f"{which}-{workers}" if which == "laplace-dask" else which
            out = scratch / f"out-{name}-{size}mb"
            subprocess.run(["rm", "-rf", str(out), str(out.parent / f".{out.name}.partial")], check=True)
            row[name] = run_one(which, corpus, str(tokenizer_path), out, workers)
            print(size, name, json.dumps(row[name]), flush=True)
        for name in [n for n in row if n.startswith("laplace-dask")]:
            if "laplace" in row:  # the fan-out's cost against the local pool, same corpus, same run
                row[f"{name}_cpu_ratio"] = row[name]["cpu_seconds"] / row["laplace"]["cpu_seconds"]
        if "laplace" in row and "nanogpt" in row:
            row["ratio_tokens_per_s"] = row["laplace"]["tokens_per_s"] / row["nanogpt"]["tokens_per_s"]
            row["ratio_peak_rss"] = row["laplace"]["peak_rss_mb"] / row["nanogpt"]["peak_rss_mb"]
        row["load_average_after"] = os.getloadavg()
        results["runs"][f"{size}MB"] = row
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")  # each row kept as it is measured

    # 100B tokens on 64 cores, from the largest run's per-core rate and per-worker memory.
    if "laplace" not in args.sides:
        return
    largest = results["runs"][f"{max(args.sizes_mb)}MB"]["laplace"]
    per_core = largest["tokens_per_s_per_core"]
    seconds = 100e9 / (per_core * 64)
    results["extrapolation_100B_tokens_64_cores"] = {
        "hours": seconds / 3600,
        "memory_gb": largest["peak_rss_mb"] / args.workers * 64 / 1e3,
        "disk_shards_gb": 100e9 * 2 / 1e9,
        "shards": int(np.ceil(100e9 / 100_000_000)),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
