"""params.yaml: reading it, `--set section.key=value` overrides, writing overrides back into
the file with its comments kept (what `dvc exp run --set-param` does), and writing the file
itself from the typed defaults, each knob's comment its doc in code (`make params`).

Both are read as YAML 1.2 with ruamel.yaml, the reader DVC itself uses on params.yaml (and the
writer below): `lr: 1e-3` is the number 0.001 here as in `dvc exp show`. PyYAML reads YAML 1.1,
where `1e-3` is a string and `yes` a boolean."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError
from ruamel.yaml.tokens import ScalarToken, ValueToken

from laplace.config import Config, config_from_dict, knob_docs
from laplace.errors import ConfigError


def add_config_arguments(p) -> None:
    """--params, --set (repeatable) and --root: what every `laplace` command takes."""
    p.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a param, e.g. --set train.lr=0.01 (repeatable)",
    )
    p.add_argument("--root", default=".", help="project root holding data/, runs/, artifacts/, metrics/")


def _reader() -> YAML:
    """A YAML 1.2 reader giving plain dicts, lists and scalars (ruamel's safe loader)."""
    return YAML(typ="safe", pure=True)


def parse_yaml(text: str) -> Any:
    """One YAML 1.2 document (a params file, or an override's value)."""
    return _reader().load(text)


def dump_yaml(data: Any) -> str:
    """`data` as YAML 1.2 text that `parse_yaml` reads back as the same values."""
    from io import StringIO

    out = StringIO()
    writer = YAML(typ="safe", pure=True)
    writer.default_flow_style = False
    writer.sort_base_mapping_type_on_output = False
    writer.dump(data, out)
    return out.getvalue()


def parse_override(text: str) -> tuple[list[str], Any]:
    """`train.lr=0.01` -> (['train', 'lr'], 0.01); the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected KEY=VALUE, e.g. train.lr=0.01")
    key, _, value = text.partition("=")
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: empty key")
    try:
        parsed = parse_yaml(value) if value.strip() else ""
    except YAMLError:
        parsed = value
    return key.split("."), parsed


def apply_overrides(raw: dict, overrides: list[str] | dict[str, Any]) -> dict:
    """Set `section.key` values in a raw params mapping (unknown keys are caught by the builder)."""
    items = overrides.items() if isinstance(overrides, dict) else (parse_override(o) for o in overrides)
    for path, value in items:
        if isinstance(path, str):
            path = path.split(".")
        node = raw
        for part in path[:-1]:
            if not isinstance(node.get(part, {}), dict):
                raise ConfigError(f"override {'.'.join(path)}: '{part}' is not a section")
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return raw


def read_params(path: str | Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: no such params file")
    try:
        text = path.read_text(encoding="utf-8")
        raw = parse_yaml(text)
    except YAMLError as exc:
        where = yaml_error_where(text, exc)
        raise ConfigError(f"{path}: {where} is not valid YAML ({getattr(exc, 'problem', exc)})") from None
    if raw is not None and not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections, got {type(raw).__name__}")
    return raw or {}


def yaml_error_where(text: str, exc: YAMLError) -> str:
    """`line N` of the mistake. The parser often notices one only on a later line (its problem mark):
    an unclosed quote or bracket where it began (its context mark), and a key missing its colon
    (`lr 0.1`) where the plain scalar swallowing the next line began. Indentation errors are at
    the problem mark."""
    problem, context = getattr(exc, "problem_mark", None), getattr(exc, "context_mark", None)
    what = getattr(exc, "context", None) or ""
    mark = context if context is not None and ("scanning" in what or "flow" in what) else problem
    if problem is not None and getattr(exc, "problem", "") == "mapping values are not allowed here":
        key_scalar, previous = None, None  # the last plain scalar that stood where a key goes
        try:
            for token in _reader().scan(text):
                if isinstance(token, ScalarToken):
                    is_value = isinstance(previous, ValueToken) and previous.start_mark.line == token.start_mark.line
                    key_scalar = None if is_value else token.start_mark
                previous = token
        except YAMLError:
            pass
        if key_scalar is not None and key_scalar.line < problem.line:
            mark = key_scalar
    return f"line {mark.line + 1}" if mark is not None else "somewhere"


def load_config(path: str | Path = "params.yaml", overrides: list[str] | dict | None = None) -> Config:
    """params.yaml + overrides -> validated Config. Raises ConfigError naming the bad key."""
    raw = read_params(path)
    if overrides:
        raw = apply_overrides(raw, overrides)
    return config_from_dict(raw)


def write_params(path: Path, overrides: list[str] | dict) -> bool:
    """Validate overrides against the params file, then write them into it, keeping its
    comments and layout (what `dvc exp run --set-param` does). Returns True if the file changed.
    Raises ConfigError naming the key before anything is written."""
    path = Path(path)
    raw = read_params(path)
    config_from_dict(apply_overrides(raw, overrides))  # one-line error on a bad key or value
    yaml = YAML()  # round-trip: comments and layout kept
    yaml.preserve_quotes = True
    doc = yaml.load(path.read_text(encoding="utf-8"))
    items = overrides.items() if isinstance(overrides, dict) else (parse_override(o) for o in overrides)
    changed = False
    for key, value in items:
        keys = key.split(".") if isinstance(key, str) else list(key)
        node = doc
        for part in keys[:-1]:
            if part not in node:
                node[part] = {}
            node = node[part]
        if node.get(keys[-1], object()) != value:
            node[keys[-1]] = value
            changed = True
    if changed:
        from io import StringIO

        from laplace.fileio import atomic_write_bytes

        out = StringIO()
        yaml.dump(doc, out)
        atomic_write_bytes(path, out.getvalue().encode("utf-8"))
    return changed


# --------------------------------------------------------------------------- params.yaml from the code

PARAMS_HEADER = """\
Laplace pipeline parameters: every knob lives here (defaults in laplace/config/ mirror this file).
Override on the command line: laplace <command> --set train.lr=0.01 --set model.preset=tiny
Laid out as `dvc exp run --set-param` writes YAML (a list item a line, empty = null, '' quotes),
so changing one value is a one-line diff (tests/test_pipeline_frame.py). The comments are the
knobs' docs in laplace/config/ (model: ModelConfig's): after changing one, run `make params`."""
COMMENT_COLUMN = 29
LINE_WIDTH = 120


def _comment(doc: str) -> str:
    """A knob's doc as an end-of-line comment, continued on lines of their own at the same column."""
    import textwrap

    lines = textwrap.wrap(doc, LINE_WIDTH - COMMENT_COLUMN - 2) or [""]
    return ("\n" + " " * COMMENT_COLUMN + "# ").join(lines)


def render_params(cfg: Config | None = None) -> str:
    """params.yaml for `cfg` (default: the defaults in code): every knob with its doc as comment,
    in the YAML layout DVC writes (ruamel round-trip), floats as PyYAML writes them (1.0e-08, which
    a YAML 1.1 reader also takes for a number)."""
    from io import StringIO

    from ruamel.yaml import YAML
    from ruamel.yaml.comments import CommentedMap, CommentedSeq

    cfg = cfg or Config()
    docs = knob_docs()
    root = CommentedMap()
    for section, values in cfg.to_dict().items():
        if not isinstance(values, dict):
            root[section] = values
        else:
            node = CommentedMap()
            for key, value in values.items():
                node[key] = CommentedSeq(value) if isinstance(value, list) else value
                if docs.get(f"{section}.{key}"):
                    node.yaml_add_eol_comment(_comment(docs[f"{section}.{key}"]), key, column=COMMENT_COLUMN)
            root[section] = node
            root.yaml_set_comment_before_after_key(section, before="\n")
        if docs.get(section):
            root.yaml_add_eol_comment(_comment(docs[section]), section, column=COMMENT_COLUMN)
    root.yaml_set_start_comment(PARAMS_HEADER)
    yaml = YAML()
    yaml.representer.add_representer(float, _represent_float)
    out = StringIO()
    yaml.dump(root, out)
    return out.getvalue()


def _represent_float(representer, value: float):
    import yaml  # PyYAML: its float form, which YAML 1.1 and 1.2 readers both take for a number

    text = yaml.safe_dump(value).split("\n", 1)[0]  # PyYAML's form: 1.0e-08, 0.003, 25.0
    return representer.represent_scalar("tag:yaml.org,2002:float", text)


def main(argv: list[str] | None = None) -> int:
    """`python -m laplace.pipeline.params [--check] [PATH]`: write params.yaml from the code (its
    knob values kept), or check that it is what the code would write."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("path", nargs="?", default="params.yaml")
    parser.add_argument("--check", action="store_true", help="exit 1 if the file differs from the code's")
    args = parser.parse_args(argv)
    path = Path(args.path)
    text = render_params(load_config(path) if path.exists() else None)
    if args.check:
        same = path.exists() and path.read_text(encoding="utf-8") == text
        print(f"{path}: {'up to date' if same else 'differs from the knobs in code: run make params'}")
        return 0 if same else 1
    from laplace.fileio import atomic_write_bytes

    atomic_write_bytes(path, text.encode("utf-8"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
