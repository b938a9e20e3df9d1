"""The shape of the house: the library never imports the pipeline, and every DVC stage depends on
every module it runs (so a code change can never leave a stage's outputs stale)."""

from __future__ import annotations

import ast
import dataclasses
import functools
import typing
from pathlib import Path

import pytest
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


@functools.cache
def source_tree(path: Path) -> ast.Module:
    """The parsed file (cached: the checks below walk the same files many times; never mutated)."""
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


@functools.cache
def imported_modules(path: Path) -> frozenset[str]:
    """Every laplace module a file imports, anywhere in it (function-level imports included)."""
    tree = source_tree(path)
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
    return frozenset(found)  # cached: shared by every caller


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


def test_no_script_folder_shadows_the_standard_library():
    """flows/ and bench/ lead sys.path when their files run as scripts (python flows/pipeline.py, as
    the Prefect tests do): a file named like a standard module (tokenize.py) is imported in its place
    by the standard library itself, and prefect then fails on a circular import."""
    import sys

    clashes = [
        str(p.relative_to(ROOT))
        for folder in ("flows", "bench", "tests")
        for p in (ROOT / folder).glob("*.py")
        if p.stem in sys.stdlib_module_names
    ]
    assert clashes == []


# Third-party packages that only one room of laplace may import (Prefect: none, it lives in flows/).
ROOM_OF = {"mlflow": "tracking", "prefect": None}


def test_prefect_lives_in_flows_and_mlflow_in_the_tracking_room():
    """A folder rule: any file under laplace/tracking/ may import mlflow (a new tracking module
    needs no entry here), no file elsewhere in laplace may; Prefect no file of laplace."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
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
                if top in ROOM_OF and rel.parts[0] != ROOM_OF[top]:
                    offenders.append(f"{rel} imports {name}")
    assert offenders == []


def test_subpackages_are_one_level_deep_and_the_rooms_exist():
    nested = [str(p.relative_to(PACKAGE)) for p in PACKAGE.glob("*/*/__init__.py")]
    assert nested == []
    for room in LIBRARY + ("tracking", "pipeline"):
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
        runs = closure({stage.module.__name__, "laplace.pipeline.params"})
        for path in sorted(runs):
            if not any(path == d or d in path.parents for d in deps):
                problems.append(f"{name}: {path.relative_to(ROOT)} ({dotted(path)}) is not in its deps")
    assert problems == [], "\n".join(problems)


def test_every_module_a_compare_arm_runs_is_a_dependency_of_the_arm():
    """The same for compare/dvc.yaml's arm stage (`laplace compare-arm`: laplace.pipeline.compare,
    which runs the pipeline's stage modules): its code deps name laplace/ through compare/laplace-src."""
    compare = ROOT / "compare"
    assert (compare / "laplace-src").resolve() == PACKAGE
    arm = yaml.safe_load((compare / "dvc.yaml").read_text())["stages"]["arm"]["do"]
    deps = [(compare / d).resolve() for d in arm["deps"]]
    assert (ROOT / "data" / "tokenized").resolve() in deps and (ROOT / "models").resolve() in deps
    runs = closure({"laplace.pipeline.compare", "laplace.pipeline.params"})
    missing = [p for p in sorted(runs) if not any(p == d or d in p.parents for d in deps)]
    assert missing == [], [str(p.relative_to(ROOT)) for p in missing]


def test_the_deps_check_sees_function_level_imports():
    """The check must not miss a lazy import inside a function (most stage imports are lazy)."""
    runs = closure({"laplace.pipeline.stage_numerics"})
    assert PACKAGE / "evals" / "numerics.py" in runs  # imported inside main()
    assert PACKAGE / "model" / "lm.py" in runs  # transitively, through the exported model


# --------------------------------------------------------------------------- declared params vs read params

# the config module that validates a Config, reading every knob (its sections read none)
CONFIG_FILE = PACKAGE / "config" / "build.py"


def knob_keys() -> dict[str, set[str]]:
    """Section name -> its keys; top-level knobs (seed) map to an empty set."""
    from laplace.config import Config

    out = {}
    for f in dataclasses.fields(Config):
        section = typing.get_type_hints(Config)[f.name]
        out[f.name] = {k.name for k in dataclasses.fields(section)} if dataclasses.is_dataclass(section) else set()
    return out


def _ends_in_cfg(node: ast.AST) -> bool:
    """`cfg`, `self.cfg`, ...: the name every Config goes by (test_a_config_is_always_named_cfg)."""
    return (isinstance(node, ast.Name) and node.id == "cfg") or (isinstance(node, ast.Attribute) and node.attr == "cfg")


def params_read(path: Path, sections: dict[str, set[str]], only: set[str] | None = None) -> set[str]:
    """The knobs a file reads from a Config: `cfg.section.key`, a whole section handed on
    (`tokenize_corpus(cfg.data, ...)`, `s = cfg.train`: every key of it), `cfg.seed`,
    `cfg.model_config()` (the model section; the tokenizer's vocab_size unless a vocab size is
    given) and `cfg.flat()` / `cfg.digest()` (everything). `cfg.to_dict()` reads nothing: it
    hands the config to a child process, whose own reads are in the same closure.
    `only`: the top-level functions and classes that run (see used_definitions); None = all."""
    body = [n for n in source_tree(path).body if only is None or not _is_definition(n) or n.name in only]
    tree = ast.Module(body=body, type_ignores=[])
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    everything = {f"{s}.{k}" for s, keys in sections.items() for k in keys} | {s for s, k in sections.items() if not k}
    found: set[str] = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _ends_in_cfg(node.value)):
            continue
        name, up = node.attr, parents.get(node)
        if name in ("flat", "digest"):
            left_out = _without(up, path)
            found |= {k for k in everything if k not in left_out and k.split(".")[0] not in left_out}
        elif name == "model_config":
            found |= {f"model.{k}" for k in sections["model"]}
            if isinstance(up, ast.Call) and not (up.args or up.keywords):
                found.add("tokenizer.vocab_size")
        elif name in sections and not sections[name]:
            found.add(name)
        elif name in sections:
            if isinstance(up, ast.Attribute) and up.value is node and up.attr in sections[name]:
                found.add(f"{name}.{up.attr}")
            elif not (isinstance(up, ast.Attribute) and up.value is node):
                found |= {f"{name}.{k}" for k in sections[name]}
    return found


def _without(call: ast.AST, path: Path) -> set[str]:
    """The knobs `cfg.flat(without=NAME)` / `cfg.digest(without=NAME)` leave out: NAME is a module-level
    tuple of strings in the same file (a literal tuple works too). Anything else: an error, so that
    the check never guesses."""
    if not isinstance(call, ast.Call):
        return set()
    given = next((k.value for k in call.keywords if k.arg == "without"), call.args[0] if call.args else None)
    if given is None:
        return set()
    if isinstance(given, ast.Name):
        bound = [
            n.value
            for n in source_tree(path).body
            if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == given.id for t in n.targets)
        ]
        given = bound[0] if len(bound) == 1 else given
    if isinstance(given, ast.Tuple) and all(isinstance(e, ast.Constant) for e in given.elts):
        return {e.value for e in given.elts}
    raise AssertionError(f"{path}: flat/digest's `without` must be a module-level tuple of strings")


def _is_definition(node: ast.AST) -> bool:
    return isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))


def used_definitions(files: set[Path], entry: set[Path]) -> dict[Path, set[str] | None]:
    """Per file, the top-level functions and classes a stage can run (None: all of them): a module
    imported whole (`import m`, `from pkg import m`), named as a string (started as a process:
    `python -m laplace.pipeline.serve`) or an entry point runs anything; from a
    module whose names are imported (`from m import f`), only those names and the definitions they
    refer to. So numerics, which takes `cross_entropy` from training/loop.py, does not read
    the train: section that the training loop in the same file reads."""
    whole, names = set(entry), {f: set() for f in files}
    for path in files:
        for node in ast.walk(source_tree(path)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and module_file(node.value):
                whole.add(module_file(node.value))  # `python -m laplace.pipeline.serve`: a process runs it all
            elif isinstance(node, ast.Import):
                whole |= {module_file(a.name) for a in node.names if module_file(a.name)}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    if sub := module_file(f"{node.module}.{alias.name}"):
                        whole.add(sub)
                    elif (target := module_file(node.module)) in names:
                        names[target].add(alias.name)
    out: dict[Path, set[str] | None] = {}
    for path in files:
        if path in whole:
            out[path] = None
            continue
        body = source_tree(path).body
        refs = {n.name: {x.id for x in ast.walk(n) if isinstance(x, ast.Name)} for n in body if _is_definition(n)}
        todo, seen = [n for n in names[path] if n in refs], set()
        while todo:
            if (name := todo.pop()) not in seen:
                seen.add(name)
                todo.extend(r for r in refs[name] if r in refs)
        out[path] = seen
    return out


def params_declared(entry: dict, sections: dict[str, set[str]]) -> set[str]:
    """The knobs a dvc.yaml stage declares: `section` (every key), `section.key`, or the whole file."""
    out: set[str] = set()
    for item in entry.get("params", []):
        if isinstance(item, dict):  # `- params.yaml:` (every knob)
            out |= {f"{s}.{k}" for s, keys in sections.items() for k in keys} | {
                s for s, k in sections.items() if not k
            }
        elif "." in item:
            out.add(item)
        else:
            out |= {f"{item}.{k}" for k in sections[item]} if sections[item] else {item}
    return out


def stage_params_problems(dvc: dict) -> list[str]:
    sections = knob_keys()
    problems = []
    for name, stage in STAGES.items():
        entry = {stage.module.__name__, "laplace.pipeline.params"}
        files = closure(entry) - {CONFIG_FILE}
        runs = used_definitions(files, {module_file(m) for m in entry})
        read = set().union(*(params_read(path, sections, runs[path]) for path in files))
        declared = params_declared(dvc[name], sections)
        problems += [f"{name}: reads {key}, not in its params in dvc.yaml" for key in sorted(read - declared)]
        problems += [f"{name}: declares {key} in dvc.yaml but never reads it" for key in sorted(declared - read)]
    return problems


def test_every_stage_declares_exactly_the_params_its_code_reads():
    """Walk each stage's import closure (as the deps check does) for the knobs it reads: a knob read
    and not declared would not rerun the stage when changed; one declared and not read reruns it
    for nothing. config/build.py is left out: it reads every knob to validate it."""
    problems = stage_params_problems(yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"])
    assert problems == [], "\n".join(problems)


def test_the_params_check_fails_both_ways():
    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    dvc["probes"]["params"] = [p for p in dvc["probes"]["params"] if p != "model.kernel"]
    dvc["export"]["params"] = dvc["export"]["params"] + ["server.port"]
    assert stage_params_problems(dvc) == [
        "export: declares server.port in dvc.yaml but never reads it",
        "probes: reads model.kernel, not in its params in dvc.yaml",
    ]


def test_params_read_sees_keys_whole_sections_and_aliases(tmp_path):
    sections = knob_keys()
    path = tmp_path / "stage.py"
    path.write_text(
        "def run(cfg, paths):\n"
        "    s = cfg.server\n"  # an alias: every key of the section
        "    tokenize(cfg.data)\n"
        "    m = cfg.model_config(vocab_size=3)\n"
        "    return cfg.engine.max_slots, self.cfg.serve_check.rate, cfg.seed, model.cfg.vocab_size\n"
    )
    read = params_read(path, sections)
    expected = {f"server.{k}" for k in sections["server"]} | {f"data.{k}" for k in sections["data"]}
    expected |= {f"model.{k}" for k in sections["model"]} | {"engine.max_slots", "serve_check.rate", "seed"}
    assert read == expected


def test_a_config_is_always_named_cfg():
    """The params check finds reads through the name `cfg`: every parameter annotated Config is so named."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.arg) and isinstance(node.annotation, ast.Name) and node.annotation.id == "Config":
                if node.arg != "cfg":
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.arg}")
    assert offenders == []


# --------------------------------------------------------------------------- imports point down


def import_graph() -> dict[str, set[str]]:
    """laplace module -> the laplace modules it imports (anywhere in it, function-level included)."""
    graph = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        graph[dotted(path)] = imported_modules(path) - {dotted(path)}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_imports_point_down_no_circle():
    """No two modules import each other, directly or around a loop, at top level or inside a function."""
    assert import_circles(import_graph()) == []


def test_the_circle_check_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_circles(graph) == [["a", "b", "c"]]


# --------------------------------------------------------------------------- layers

# The rooms of laplace, lowest first. A module imports only its own room and the rooms of lower
# layers; rooms that share a layer are independent (data, model and optim never import each
# other: what two of them share is a base module, as laplace/sharding.py and
# laplace/tokenizer_file.py are). "base" is every module directly under laplace/ (errors,
# fileio, runtime, manifest, progress, processes, ...); "config" is laplace/config/, the knobs'
# sections, which every room above reads and no base module needs.
LAYERS = (
    ("base",),
    ("config",),
    ("data", "model", "optim"),
    ("training",),
    ("serving",),
    ("evals",),
    ("tracking",),
    ("pipeline",),
)
# Imports the layers allow although they point up, each with why. The importer's target must
# itself import nothing above the base (test_the_allowed_upward_imports_are_leaves).
UPWARD_ALLOWED = {
    # config/model.py's model: section is ModelConfig's fields (one knob, one place), and
    # ModelConfig lives beside the model it configures
    ("laplace.config.model", "laplace.model.config"),
}


def room_of(module: str, package: Path = PACKAGE) -> str:
    """`laplace.serving.engine` -> serving; a module directly under laplace/ (or laplace itself) -> base."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (package / parts[1]).is_dir()) else "base"


def layer_of(room: str) -> int:
    return next(i for i, rooms in enumerate(LAYERS) if room in rooms)


def package_imports(package: Path) -> dict[str, set[str]]:
    """module -> the modules of `package` it imports (function-level included), for any tree laid
    out as laplace is (so the check can run on a planted tree too)."""
    top = package.parent

    def known(name: str) -> bool:
        base = top.joinpath(*name.split("."))
        return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()

    graph = {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(top).with_suffix("")
        me = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            found |= {n for n in names if n.split(".")[0] == package.name and known(n)}
        graph[me] = found - {me}
    return graph


def layer_violations(package: Path) -> list[str]:
    """Every import of a higher layer's room, or of another room of the same layer, in `package`."""
    out = []
    for module, targets in sorted(package_imports(package).items()):
        mine = room_of(module, package)
        for target in sorted(targets):
            theirs = room_of(target, package)
            if theirs == mine or (module, target) in UPWARD_ALLOWED:
                continue
            if layer_of(theirs) > layer_of(mine):
                out.append(f"{module} ({mine}) imports {target} ({theirs}): a higher layer")
            elif layer_of(theirs) == layer_of(mine):
                out.append(f"{module} ({mine}) imports {target} ({theirs}): a room beside it")
    return out


def test_every_room_is_in_a_layer():
    rooms = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert rooms | {"base"} == {room for layer in LAYERS for room in layer}


def test_imports_follow_the_layers():
    """base, then data | model | optim, training, serving, evals, tracking, pipeline."""
    problems = layer_violations(PACKAGE)
    assert problems == [], "imports against the layers:\n" + "\n".join(problems)


def test_the_allowed_upward_imports_are_leaves():
    """An allowed upward import may not carry a room along: its target imports only base modules."""
    graph = package_imports(PACKAGE)
    for _, target in sorted(UPWARD_ALLOWED):
        assert {room_of(m) for m in graph[target]} <= {"base"}, target


def test_the_layer_check_finds_planted_violations(tmp_path):
    """The checker run on a tree with an upward, a sideways and a lazy upward import."""
    pkg = tmp_path / "laplace"
    for room in ("data", "model", "serving"):
        (pkg / room).mkdir(parents=True)
        (pkg / room / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("")
    (pkg / "data" / "shards.py").write_text("from laplace import errors\n")  # down: fine
    (pkg / "serving" / "engine.py").write_text("import laplace.model.lm\n")  # down: fine
    (pkg / "model" / "lm.py").write_text("from laplace.data.shards import x\n")  # beside
    (pkg / "model" / "export.py").write_text("def f():\n    from laplace.serving import engine\n")  # up, lazily
    assert layer_violations(pkg) == [
        "laplace.model.export (model) imports laplace.serving (serving): a higher layer",
        "laplace.model.export (model) imports laplace.serving.engine (serving): a higher layer",
        "laplace.model.lm (model) imports laplace.data.shards (data): a room beside it",
    ]


# --------------------------------------------------------------------------- tests found by name

# Suites about the whole rather than one module (each says so in its docstring).
WHOLE_HOUSE_SUITES = {
    "layout",  # this file: the import graph, dvc.yaml deps and params
    "readme",  # every README command runs
    "sizes",  # no class, function or module in laplace/ over its size
    "security",  # secrets, pickles, bound addresses, paths
    "faults",  # kills and full disks across training processes
    "load",  # the engine and the server under overload
    "decode_step",  # the decode step as one graph (engine, lm, sampling together)
    "pipeline_dvc",  # the pipeline end to end through each front door
    "pipeline_frame",
    "pipeline_prefect",
    "pipeline_real_model",  # an fla checkpoint through import, the pipeline, serve and lm-eval
    "suite_timing",  # the test suite's own durations record (tests/suite_timing.py)
    "compiler_cache",  # the test suite's own C++ compiler (tests/compiler/g++)
}


def test_a_modules_tests_are_found_from_its_name():
    """tests/test_<name>.py tests the module, package or stage <name> (test_engine.py:
    laplace/serving/engine.py, test_data.py: laplace/data/), or is one of WHOLE_HOUSE_SUITES."""
    names = {p.stem for p in PACKAGE.rglob("*.py")} | {p.name for p in PACKAGE.iterdir() if p.is_dir()}
    names |= set(STAGES)
    strays = [
        p.name
        for p in sorted((ROOT / "tests").glob("test_*.py"))
        if p.stem.removeprefix("test_") not in names | WHOLE_HOUSE_SUITES
    ]
    assert strays == []


def test_the_params_check_reads_what_flat_and_digest_leave_out(tmp_path):
    sections = knob_keys()
    path = tmp_path / "track.py"
    path.write_text(
        'NOT_THE_RUN = ("server.port", "pipeline")\n'
        "def log(cfg):\n"
        "    return cfg.flat(without=NOT_THE_RUN), cfg.digest(without=NOT_THE_RUN)\n"
    )
    read = params_read(path, sections)
    assert "server.port" not in read and "server.host" in read and "seed" in read
    assert not any(k.startswith("pipeline.") for k in read) and "probes.seed" in read
    guessed = tmp_path / "guess.py"  # another file: source_tree caches by path
    guessed.write_text("def log(cfg, keys):\n    return cfg.flat(without=keys)\n")
    with pytest.raises(AssertionError, match="module-level tuple of strings"):
        params_read(guessed, sections)


def test_every_test_file_and_bench_the_gpu_check_runs_exists():
    """bench/gpu_check.sh runs only where a GPU is lent, so a renamed file there fails nowhere else."""
    import re

    script = (ROOT / "bench" / "gpu_check.sh").read_text()
    named = set(re.findall(r"\b((?:tests|bench)/[\w/]+\.py)\b", script))
    assert {"tests/test_kernels.py", "bench/gdn_vs_gla.py"} <= named
    assert not [path for path in sorted(named) if not (ROOT / path).is_file()]
