"""The size of the house's rooms: no class in laplace/ over 20 methods, no function over 80 lines,
no module over 700 lines. A reader should not have to scroll through one job to find the next;
a class that large is usually a facade forwarding other objects' state (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "laplace"
MAX_METHODS = 20
MAX_FUNCTION_LINES = 80  # from `def` to the last line of the body; decorators not counted
MAX_MODULE_LINES = 700


def oversized(path: Path) -> list[str]:
    """Every class, function (nested ones too, counted inside their parent as well) and the module
    itself that is over its limit, as `file:line name (size)`."""
    text = path.read_text(encoding="utf-8")
    rel = path.relative_to(PACKAGE.parent)
    found = []
    if (lines := len(text.splitlines())) > MAX_MODULE_LINES:
        found.append(f"{rel}: module of {lines} lines (> {MAX_MODULE_LINES})")
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{rel}:{node.lineno} function {node.name} of {length} lines (> {MAX_FUNCTION_LINES})")
        elif isinstance(node, ast.ClassDef):
            methods = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in node.body)
            if methods > MAX_METHODS:
                found.append(f"{rel}:{node.lineno} class {node.name} with {methods} methods (> {MAX_METHODS})")
    return found


def test_no_class_function_or_module_in_laplace_is_over_its_size():
    problems = [p for path in sorted(PACKAGE.rglob("*.py")) for p in oversized(path)]
    assert problems == [], "\n".join(problems)


def test_the_size_check_finds_each_kind_of_oversize(tmp_path, monkeypatch):
    """The walk must see a long nested function, a class of 21 methods (properties count) and a long module."""
    monkeypatch.setattr("test_sizes.PACKAGE", tmp_path)
    body = "\n".join(f"        x{i} = {i}" for i in range(80))
    methods = "\n".join(f"    @property\n    def m{i}(self):\n        return {i}\n" for i in range(21))
    source = f"def outer():\n    def inner():\n{body}\n    return inner\n\n\nclass Facade:\n{methods}\n"
    source += "\n" * (MAX_MODULE_LINES - source.count("\n") + 1)
    path = tmp_path / "big.py"
    path.write_text(source)
    found = oversized(path)
    assert [f.split(" ", 2)[1:] for f in found] == [
        ["module", f"of {MAX_MODULE_LINES + 1} lines (> {MAX_MODULE_LINES})"],
        ["function", "outer of 83 lines (> 80)"],
        ["class", "Facade with 21 methods (> 20)"],
        ["function", "inner of 81 lines (> 80)"],
    ]
    # exactly at the limits: nothing
    path.write_text("def f():\n" + "\n".join(f"    x{i} = {i}" for i in range(79)) + "\n")
    assert oversized(path) == []
