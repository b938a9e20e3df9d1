"""Does the probes stage's MQAR model learn at params.yaml's defaults? A check of the recipe, not a speed.

The probes stage trains a small GLA on MQAR (`probes.train_mqar`, `probes.mqar_train_*`) so that the
recall suite is seen to measure something. This trains it as the stage does (laplace.evals.mqar's
train_mqar, the defaults of params.yaml's probes section), scores it per (context, pairs), runs the
recall suite's MQAR on it through a serving engine, and exits 1 when the recipe did not learn:
  - the easiest cell (shortest context, fewest pairs) at >= 0.9 (seeds 0-3 gave 0.96-1.0),
  - more pairs, and a longer context with the most pairs, each lower by > 0.1,
  - the final loss below half the plateau ln(values) it starts on,
  - the recall suite's verdict "recall above chance" at the shortest context.
About 4 minutes on 2 cores; out of the test suite for that reason (the trainer's learning is tested
there by tests/test_mqar_protocol.py, on the protocol's models). Results: bench/RESULTS.md.

    .venv/bin/python bench/mqar_probe.py              # the defaults; exit 1 if they do not learn
    .venv/bin/python bench/mqar_probe.py --seed 1
    .venv/bin/python bench/mqar_probe.py --steps 5 --contexts 64 256 --samples 4   # cut: runs in seconds, fails
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, machine, print_table  # noqa: E402


def check(result: dict, recall: dict, contexts: list[int], pairs: list[int]) -> list[str]:
    """The recipe's failures (empty when it learned), each a line naming the figure."""
    acc = result["accuracy"]
    shortest, longest = min(contexts), max(contexts)
    easiest = acc[shortest][min(pairs)]
    hardest_same_context = acc[shortest][max(acc[shortest])]
    hardest = acc[longest][max(acc[longest])]
    plateau = math.log(1 / result["chance"])  # ln(values): the loss of a uniform guess among them
    failures = []
    if easiest < 0.9:
        failures.append(f"easiest cell ({shortest} tokens, {min(pairs)} pairs) at {easiest:.3f} < 0.9")
    if not hardest_same_context < easiest - 0.1:
        failures.append(f"more pairs at {shortest} tokens: {hardest_same_context:.3f}, not below {easiest - 0.1:.3f}")
    if not hardest < easiest - 0.1:
        failures.append(f"{longest} tokens, most pairs: {hardest:.3f}, not below {easiest - 0.1:.3f}")
    if not result["final_loss"] < 0.5 * plateau:
        failures.append(f"final loss {result['final_loss']:.3f} not below half the plateau ln(values) = {plateau:.3f}")
    verdict = recall["recall_trained_mqar_verdict"][shortest]
    if verdict != "recall above chance: mqar":
        failures.append(f"recall suite at {shortest} tokens: {verdict!r}")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: params.yaml's)")
    parser.add_argument("--contexts", type=int, nargs="+", default=None, help="scored lengths (default: params.yaml's)")
    parser.add_argument("--samples", type=int, default=None, help="sequences per cell (default: params.yaml's)")
    args = parser.parse_args(argv)

    import dataclasses

    from laplace.config import Config
    from laplace.evals.mqar import train_mqar
    from laplace.evals.probes import trained_recall

    cfg = Config()
    cut = {"mqar_train_steps": args.steps, "mqar_contexts": args.contexts, "mqar_samples": args.samples}
    probes = dataclasses.replace(cfg.probes, **{k: v for k, v in cut.items() if v is not None})
    started = time.perf_counter()
    result = train_mqar(probes, seed=args.seed, progress=False)
    recall = trained_recall(result["trained_model"], cfg, probes, progress=False)
    seconds = time.perf_counter() - started
    acc = result["accuracy"]
    print_table(
        ["context"] + [f"{p} pairs" for p in probes.mqar_pairs],
        [[c] + [acc[c].get(p, float("nan")) for p in probes.mqar_pairs] for c in sorted(acc)],
    )
    failures = check(result, recall, probes.mqar_contexts, probes.mqar_pairs)
    for line in failures:
        print(f"FAILED: {line}")
    emit(
        {
            "machine": machine(),
            "seed": args.seed,
            "steps": probes.mqar_train_steps,
            "accuracy": {str(c): {str(p): a for p, a in row.items()} for c, row in acc.items()},
            "final_loss": result["final_loss"],
            "recall_verdict": {str(k): v for k, v in recall["recall_trained_mqar_verdict"].items()},
            "seconds": seconds,
            "learned": not failures,
            "failures": failures,
        }
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
