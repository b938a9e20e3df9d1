"""The suite's C++ compiler (tests/compiler/g++): it hands back a kept output only for the same
compiler, arguments and file contents, and otherwise is g++."""

import os
import subprocess
from pathlib import Path

WRAPPER = Path(__file__).parent / "compiler" / "g++"
SOURCE = 'extern "C" int answer() { return %d; }\n'


def compile_with(tmp_path: Path, source: Path, output: Path, store: Path | None, *flags: str):
    """The wrapper over a g++ that counts its compiles (a line per run in calls.txt)."""
    counting = tmp_path / "counting-g++"
    if not counting.exists():
        counting.write_text(
            f'#!/bin/sh\n[ "$1" = -dumpfullversion ] || echo run >> {tmp_path}/calls.txt\nexec g++ "$@"\n'
        )
        counting.chmod(0o755)
    env = {**os.environ, "LAPLACE_REAL_CXX": str(counting), "LAPLACE_CXX_CACHE": str(store or "")}
    args = [str(WRAPPER), str(source), "-shared", "-fPIC", *flags, "-o", str(output)]
    return subprocess.run(args, env=env, capture_output=True, text=True)


def runs(tmp_path: Path) -> int:
    calls = tmp_path / "calls.txt"
    return len(calls.read_text().splitlines()) if calls.exists() else 0


def test_the_same_source_and_flags_are_compiled_once_and_anything_else_again(tmp_path):
    store = tmp_path / "store"
    first, second = tmp_path / "a" / "k.cpp", tmp_path / "b" / "k.cpp"  # two compile caches' paths
    for source in (first, second):
        source.parent.mkdir()
        source.write_text(SOURCE % 42)
    assert compile_with(tmp_path, first, tmp_path / "a" / "k.so", store).returncode == 0
    assert runs(tmp_path) == 1 and len(list(store.iterdir())) == 1
    assert compile_with(tmp_path, second, tmp_path / "b" / "k.so", store).returncode == 0
    assert runs(tmp_path) == 1  # kept: same content at another path, output path left out of the key
    assert (tmp_path / "a" / "k.so").read_bytes() == (tmp_path / "b" / "k.so").read_bytes()
    compile_with(tmp_path, second, tmp_path / "b" / "k.so", store, "-O2")
    assert runs(tmp_path) == 2  # another flag
    second.write_text(SOURCE % 43)
    compile_with(tmp_path, second, tmp_path / "b" / "k.so", store)
    assert runs(tmp_path) == 3 and len(list(store.iterdir())) == 3  # another content


def test_sources_that_differ_only_in_comment_lines_share_one_output(tmp_path):
    """AOTInductor writes its compile command, with the compile cache's path, as comments into each
    source: the same graph compiled in two caches is one compile; a line moved still counts."""
    store = tmp_path / "store"
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        command = f"// Compile cmd\n// g++ {tmp_path / name}/k.cpp -shared -o {tmp_path / name}/k.so\n"
        (tmp_path / name / "k.cpp").write_text(SOURCE % 7 + command)
        assert compile_with(tmp_path, tmp_path / name / "k.cpp", tmp_path / name / "k.so", store).returncode == 0
    assert runs(tmp_path) == 1
    (tmp_path / "c").mkdir()
    # the same code a line lower: its line numbers (__LINE__, debug lines) differ, so another compile
    (tmp_path / "c" / "k.cpp").write_text("// Compile cmd\n" + SOURCE % 7)
    compile_with(tmp_path, tmp_path / "c" / "k.cpp", tmp_path / "c" / "k.so", store)
    assert runs(tmp_path) == 2


def test_a_failed_compile_keeps_nothing_and_no_store_means_plain_gxx(tmp_path):
    store = tmp_path / "store"
    broken = tmp_path / "broken.cpp"
    broken.write_text("int answer( {\n")
    done = compile_with(tmp_path, broken, tmp_path / "broken.so", store)
    assert done.returncode != 0 and "error" in done.stderr and not store.exists()
    good = tmp_path / "good.cpp"
    good.write_text(SOURCE % 1)
    for _ in range(2):
        assert compile_with(tmp_path, good, tmp_path / "good.so", None).returncode == 0
    assert runs(tmp_path) == 3 and not store.exists()  # both compiled: nothing kept without a store
    version = subprocess.run([str(WRAPPER), "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and "g++" in version.stdout  # what Inductor asks the compiler
