"""The offline default corpus (`data.source: python-docs`): the Python Language Reference topics
and the standard library's docstrings, about 1.7 MB of English that ships with every Python."""

from __future__ import annotations

import ast
import functools
import os
import re
import sysconfig
from pathlib import Path

# A reST-style underline: a run of one punctuation character under a heading.
_UNDERLINE = re.compile(r"^([*=\-~^\"#+])\1{2,}\s*$")
_MIN_DOC_CHARS = 300  # shorter topic sections are merged into the next one
_MAX_DOC_CHARS = 4000  # longer ones are cut into paragraph groups
_MIN_DOCSTRING_CHARS = 200
_SKIPPED_STDLIB_DIRS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages", "__pycache__"}


def _topic_sections(text: str) -> list[str]:
    """Split a reference topic at its headings (a line followed by an underline of the same length)."""
    lines = text.splitlines()
    sections: list[list[str]] = [[]]
    for i, line in enumerate(lines):
        following = lines[i + 1] if i + 1 < len(lines) else ""
        is_heading = line.strip() and _UNDERLINE.match(following) and len(following.strip()) == len(line.rstrip())
        if is_heading and any(s.strip() for s in sections[-1]):
            sections.append([])
        sections[-1].append(line)
    texts = ("\n".join(section).strip() for section in sections)
    return [text for text in texts if text]


def _pack_paragraphs(text: str, max_chars: int) -> list[str]:
    """Cut a long text at blank lines into groups of at most ~max_chars."""
    groups, current, size = [], [], 0
    for paragraph in re.split(r"\n\s*\n", text):
        if current and size + len(paragraph) > max_chars:
            groups.append("\n\n".join(current))
            current, size = [], 0
        current.append(paragraph)
        size += len(paragraph) + 2
    if current:
        groups.append("\n\n".join(current))
    return groups


def _reference_documents() -> list[str]:
    from pydoc_data.topics import topics

    documents = []
    for name in sorted(topics):
        pending = ""  # short sections wait to be glued to the next one
        for section in _topic_sections(topics[name]):
            section = f"{pending}\n\n{section}" if pending else section
            if len(section) < _MIN_DOC_CHARS:
                pending = section
                continue
            pending = ""
            documents.extend(_pack_paragraphs(section, _MAX_DOC_CHARS))
        if pending:
            if documents and len(pending) < _MIN_DOC_CHARS:
                documents[-1] = f"{documents[-1]}\n\n{pending}"
            else:
                documents.append(pending)
    return documents


def _stdlib_sources() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIPPED_STDLIB_DIRS]
        paths.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(paths)


def _docstrings(path: Path) -> list[str]:
    """Module, class and function docstrings of one source file, in source order (never imported)."""
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, RecursionError, OSError):
        return []
    nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    nodes.sort(key=lambda n: (n.lineno, n.col_offset))
    found = []
    for node in [tree, *nodes]:
        doc = ast.get_docstring(node)
        if doc and len(doc) >= _MIN_DOCSTRING_CHARS:
            found.append(doc)
    return found


@functools.lru_cache(maxsize=1)
def _python_docs_cached() -> tuple[str, ...]:
    documents = _reference_documents()
    for path in _stdlib_sources():
        documents.extend(_docstrings(path))
    # Exact duplicates (re-exported docstrings) would leak between train and val.
    return tuple(dict.fromkeys(documents))


def python_docs_documents() -> list[str]:
    """The offline default corpus: Language Reference topics plus stdlib docstrings, in a fixed order."""
    return list(_python_docs_cached())
