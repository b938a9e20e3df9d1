"""The architecture comparison as a Prefect flow: the corpus and its shards, then one task per arm
of params.yaml's compare.arms and one per cell of the MQAR protocol (mqar.*), its summary, then the
table.

Each task is `dvc repro --single-item` of its stage: corpus and tokenize in the project's dvc.yaml,
the arms and the table in compare/ (a DVC repository of its own), so DVC decides what is up to date
(a finished arm is not run again, an added arm is the only one run) and dvc.lock records what ran,
whichever front door started it. The arms are submitted together, each its own task run with its
own retries and logs; DVC allows one `dvc repro` at a time in a repository, so on one machine they
run one after another.

    python flows/compare.py                                   # once, no server needed
    prefect deployment run 'laplace-compare/tiny' --watch     # via a server and worker (README)
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run

from flows.pipeline import retry_transient, run_stage
from laplace.pipeline.params import load_config, write_params

# `dvc repro` holds the repository's lock for its whole run: a second one at once fails
_DVC_LOCK = threading.Lock()


@task
def run_compare_stage(stage: str, root: str, flow_run_id: str) -> dict:
    """flows.pipeline's stage task, one at a time (DVC's lock)."""
    with _DVC_LOCK:
        return run_stage.fn(stage, root, flow_run_id)


def _submit(cfg, stage: str, root: Path, run_id: str, wait_for=None):
    """`stage` of the DVC repository at `root` (the project, or its compare/)."""
    options = dict(
        name=f"stage-{stage.split(':')[-1]}",
        retries=cfg.pipeline.retries,
        retry_delay_seconds=cfg.pipeline.retry_delay_s,
        timeout_seconds=cfg.pipeline.stage_timeout_s,
        retry_condition_fn=retry_transient,
    )
    return run_compare_stage.with_options(**options).submit(stage, str(root), run_id, wait_for=wait_for)


def mqar_cell_stages(cfg) -> list[str]:
    """The MQAR protocol's cells as compare/dvc.yaml's matrix names them (values as Python prints them)."""
    m = cfg.mqar
    return [f"cell@{a}-{w}-{lr}-{s}" for a in m.arms for w in m.widths for lr in m.lrs for s in m.seeds]


@flow(name="laplace-compare")
def compare(overrides: dict[str, Any] | None = None, root: str | None = None) -> dict:
    """Train and measure every arm of compare.arms, then write the table. `overrides`
    ({"compare.overrides": {...}, "train.seed": 1}) are written into params.yaml first, as
    `dvc exp run --set-param` would, so dvc.lock records them."""
    from laplace.pipeline.compare import COMPARE_DIR, check_arms
    from laplace.pipeline.compare_mqar import arm_models, check_protocol
    from laplace.pipeline.compare_table import format_table, table_file
    from laplace.pipeline.layout import Paths

    logger = get_run_logger()
    root_path = Path(root or os.getcwd()).resolve()
    params_file = root_path / "params.yaml"
    if overrides:
        write_params(params_file, overrides)
    cfg = load_config(params_file)
    check_arms(cfg)  # every arm's config before any work: a bad arm is one line, never retried
    check_protocol(cfg.mqar, arm_models(cfg))
    run_id = str(flow_run.id or "local")

    data = _submit(cfg, "tokenize", root_path, run_id, wait_for=[_submit(cfg, "corpus", root_path, run_id)])
    compare_root = root_path / COMPARE_DIR
    arms = [_submit(cfg, f"arm@{arm}", compare_root, run_id, wait_for=[data]) for arm in cfg.compare.arms]
    cells = [_submit(cfg, stage, compare_root, run_id) for stage in mqar_cell_stages(cfg)]
    mqar = _submit(cfg, "mqar", compare_root, run_id, wait_for=cells)
    table = _submit(cfg, "table", compare_root, run_id, wait_for=[*arms, mqar])
    table.result()
    result = json.loads(table_file(Paths.at(root_path)).read_text())
    text = format_table(result, cfg.compare.table_contexts)
    logger.info("the comparison:\n%s", text)
    create_markdown_artifact(f"```\n{text}\n```", key="laplace-compare", description="the architecture comparison")
    return {"pick": result["pick"], "headline": result["headline"], "arms": list(result["arms"])}


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(description="run the architecture comparison flow once (no server needed)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    from laplace.pipeline.params import parse_override

    overrides = {".".join(k): v for k, v in (parse_override(o) for o in args.overrides)}
    print(json.dumps(compare(overrides=overrides), indent=2, default=str))
