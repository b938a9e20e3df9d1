"""The shape of the house: the library never imports the pipeline, and every DVC stage depends on
every module it runs (so a code change can never leave a stage's outputs stale)."""

from __future__ import annotations

import ast
from pathlib import Path

import yaml

from laplace.pipeline.stages import STAGES

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "laplace"
LIBRARY = ("model", "optim", "data", "training", "serving", "evals")


def module_file(name: str) -> Path | None:
    """The source file of a laplace module (None for names outside the package)."""
    parts = name.split(".")
    if parts[0] != "laplace":
        return None
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_modules(path: Path) -> set[str]:
    """Every laplace module a file imports, anywhere in it (function-level imports included)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from laplace.pipeline import repro` imports the module laplace.pipeline.repro
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(n for n in names if module_file(n) is not None)
    return found


def closure(start: set[str]) -> set[Path]:
    """The files of `start` and of everything they import, transitively, package __init__s included."""
    todo, seen = list(start), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))  # parent packages run first
        todo.extend(imported_modules(module_file(name)))
    return {module_file(n) for n in seen}


def dotted(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def test_the_library_never_imports_the_pipeline():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] == "pipeline":
            continue
        bad = sorted(m for m in imported_modules(path) if m.startswith("laplace.pipeline"))
        offenders += [f"{rel}: {m}" for m in bad]
    assert offenders == [], "library modules import laplace.pipeline:\n" + "\n".join(offenders)


def test_prefect_lives_in_flows_and_mlflow_in_the_tracking_modules():
    allowed = {"mlflow": {"pipeline/tracking.py", "pipeline/mlflow_model.py"}, "prefect": set()}
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(PACKAGE))
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if isinstance(node, ast.ImportFrom) and node.module
                else []
            )
            for name in names:
                top = name.split(".")[0]
                if top in allowed and rel not in allowed[top]:
                    offenders.append(f"{rel} imports {name}")
    assert offenders == []


def test_subpackages_are_one_level_deep_and_the_rooms_exist():
    nested = [str(p.relative_to(PACKAGE)) for p in PACKAGE.glob("*/*/__init__.py")]
    assert nested == []
    for room in LIBRARY + ("pipeline",):
        assert (PACKAGE / room / "__init__.py").is_file(), room


def test_every_module_a_stage_runs_is_a_dependency_of_that_stage():
    """A stage runs its stage module (whose workers run modules of their own) on params read by
    laplace.pipeline.params: all of them, transitively, must be covered by the stage's deps in
    dvc.yaml (a file, or a directory above it). The CLI around them only dispatches (argument
    parsing, the summary), so it is left out: a help text change must not rerun the pipeline."""
    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    assert set(dvc) == set(STAGES)
    problems = []
    for name, stage in STAGES.items():
        deps = [ROOT / d for d in dvc[name].get("deps", [])]
        runs = closure({f"laplace.pipeline.{stage.module}", "laplace.pipeline.params"})
        for path in sorted(runs):
            if not any(path == d or d in path.parents for d in deps):
                problems.append(f"{name}: {path.relative_to(ROOT)} ({dotted(path)}) is not in its deps")
    assert problems == [], "\n".join(problems)


def test_the_deps_check_sees_function_level_imports():
    """The check must not miss a lazy import inside a function (most stage imports are lazy)."""
    runs = closure({"laplace.pipeline.stage_numerics"})
    assert PACKAGE / "evals" / "numerics.py" in runs  # imported inside main()
    assert PACKAGE / "model" / "lm.py" in runs  # transitively, through the exported model
