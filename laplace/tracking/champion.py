"""The champion rule: when a newly registered model version takes the `champion` alias.

It takes it only when its gates pass (serve-check, numerics, probes) and its validation loss,
on the same validation windows and tokenizer (COMPARABLE_TAGS), is no worse than the current
champion's plus `tracking.champion_tolerance`. Every version gets `candidate`; the decision
and its reason become the run's tags `registered_as` and `registered_reason`
(laplace.tracking.runs applies them). Pure: no MLflow here.
"""

from __future__ import annotations

import math

# Run tags that say on what the validation loss was measured: two runs compare only when all agree.
COMPARABLE_TAGS = {
    "val_split_sha256": "validation split",
    "tokenizer_sha256": "tokenizer",
    "val_windows": "validation windows",
}


def champion_decision(
    new: dict, champion: dict | None, tolerance: float, recall_tolerance: float = 0.05
) -> tuple[bool, str]:
    """(take champion?, why). `new` and `champion` hold `val_loss`, the COMPARABLE_TAGS, `recall`
    ({task: {context: accuracy}} of the probes' recall suite, optional) and (for the champion)
    `version`; `new` also holds `gates` (stage -> True/False/None). A candidate whose recall at
    any (task, length) both measured falls below the champion's by more than `recall_tolerance`
    (tracking.champion_recall_tolerance) and, where both sides say how many prompts each accuracy
    counts (`recall_samples`), by more than two binomial standard errors of the difference, is
    refused, whatever its loss: at 4 samples an accuracy moves in steps of 25%, one prompt of noise."""
    failed = [f"{stage} {'failed' if ok is False else 'missing'}" for stage, ok in new["gates"].items() if not ok]
    if failed:
        return False, f"gates not passed ({', '.join(failed)})"
    if new.get("val_loss") is None:
        return False, "no validation loss to compare"
    if champion is None:
        return True, "gates passed; no champion before"
    name = f"champion v{champion['version']}"
    differ = [what for key, what in COMPARABLE_TAGS.items() if not new.get(key) or new.get(key) != champion.get(key)]
    if differ:
        return False, f"not comparable with {name}: different {', '.join(differ)}"
    if champion.get("val_loss") is None:
        return False, f"not comparable with {name}: it has no validation loss"
    samples = (new.get("recall_samples"), champion.get("recall_samples"))
    lost = recall_losses(new.get("recall") or {}, champion.get("recall") or {}, recall_tolerance, samples)
    if lost:
        more = f" (and {len(lost) - 1} more)" if len(lost) > 1 else ""
        return False, (
            f"recall fell below {name}'s: {lost[0]}{more} "
            f"(tolerance {recall_tolerance:g}, tracking.champion_recall_tolerance)"
        )
    limit = champion["val_loss"] + tolerance
    if new["val_loss"] <= limit:
        return True, (
            f"validation loss {new['val_loss']:.4f} <= {name}'s {champion['val_loss']:.4f} + tolerance {tolerance:g}"
        )
    return False, (
        f"validation loss {new['val_loss']:.4f} is worse than {name}'s {champion['val_loss']:.4f} "
        f"(tolerance {tolerance:g}, tracking.champion_tolerance)"
    )


def _at(grid: dict, ctx: int) -> float:
    return next((v for c, v in grid.items() if int(c) == ctx), float("nan"))


def sampling_error(got: float, old: float, n_new: int, n_old: int) -> float:
    """The binomial standard error of the difference of two accuracies (pooled proportion)."""
    pooled = (got * n_new + old * n_old) / (n_new + n_old)
    return math.sqrt(pooled * (1 - pooled) * (1 / n_new + 1 / n_old))


def recall_losses(
    new: dict, champion: dict, tolerance: float, samples: tuple[int | None, int | None] = (None, None)
) -> list[str]:
    """Where `new` recalls less than `champion` ({task: {context: accuracy}}) by more than
    `tolerance` and (with both sample counts known) two standard errors of the difference, as
    "task at N tokens: a < b (n vs m samples, ...)"; a length the candidate did not measure is a loss."""
    n_new, n_old = samples
    counted = bool(n_new) and bool(n_old)
    out = []
    for task, grid in sorted(champion.items()):
        for ctx, old in sorted(grid.items(), key=lambda kv: int(kv[0])):
            got = _at(new.get(task, {}), int(ctx))
            if old != old:
                continue
            if got != got:
                out.append(f"{task} at {ctx} tokens: not measured < {old:.0%}")
                continue
            noise = 2 * sampling_error(got, old, n_new, n_old) if counted else 0.0
            if got < old - max(tolerance, noise):
                why = f" ({n_new} vs {n_old} samples, beyond 2 standard errors {noise:.2f})" if counted else ""
                out.append(f"{task} at {ctx} tokens: {got:.0%} < {old:.0%}{why}")
    return out
