"""The suite's C++ compiler: g++ with its outputs kept by content (what ccache does), so a kernel
Inductor compiles in one process is not compiled again in the next. Every pipeline stage, server
and worker the suite starts compiles into a compile cache of its own, on purpose (a fresh
deployment); the same kernels then cost a g++ run each (about 0.65 s, 0.46 s of it loading the
155 MB precompiled header; an AOTInductor package's wrapper about 4 s).
The conftest points CXX at g++ beside this file (a launcher: the name tells Inductor it is GCC)
for the suite only; the product compiles with plain g++.

Ours, not ccache or sccache: ccache is not on PyPI (the suite installs from pip only), and
sccache runs a server daemon that outlives the process trees the tests check for orphans.

The key is what decides the output: the compiler's version, the arguments, and the content of
every argument that names a file (the kernel's source, the objects linked, the header `-include`
names: its path is itself Inductor's hash of that header's content), with the output path left
out. A C++ source's comment lines are blanked for the key (not in the file g++ reads): AOTInductor
writes its compile command, with the compile cache's path, as comments into each source, so the
same graph compiled in another directory would never hit; blank lines keep every line number, so
`__LINE__` cannot differ. Anything else (a precompiled header, preprocessing, `--version`) goes to
g++ untouched. The outputs live in $LAPLACE_CXX_CACHE; without it this is plain g++."""

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REAL = os.environ.get("LAPLACE_REAL_CXX", "g++")
KEPT = (".so", ".o")  # kernels, ISA probes, AOTInductor objects; not .gch (one per machine) nor .i


SOURCES = (".cpp", ".cc", ".c")


def content_hash(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        if path.endswith(SOURCES):  # comment lines blanked, every line kept (the docstring says why)
            for line in f:
                digest.update(b"\n" if line.lstrip().startswith(b"//") else line)
        else:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def key(args: list[str], output_at: int) -> str:
    compiler = subprocess.run([REAL, "-dumpfullversion"], capture_output=True, text=True).stdout
    digest = hashlib.sha256(f"{REAL} {compiler}".encode())
    for i, arg in enumerate(args):
        if i == output_at:
            arg = "<output>"
        elif os.path.isfile(arg):
            arg = f"<file {content_hash(arg)}>"
        digest.update(arg.encode() + b"\0")
    return digest.hexdigest()


def main() -> int:
    args = sys.argv[1:]
    store = os.environ.get("LAPLACE_CXX_CACHE")
    output_at = args.index("-o") + 1 if "-o" in args[:-1] else -1
    if not store or output_at < 0 or not args[output_at].endswith(KEPT) or "-E" in args:
        os.execvp(REAL, [REAL, *args])
    output = Path(args[output_at])
    kept = Path(store) / key(args, output_at)
    if kept.is_file():
        shutil.copyfile(kept, output)
        return 0
    status = subprocess.run([REAL, *args]).returncode
    if status == 0 and output.is_file():
        Path(store).mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(dir=store, prefix=".partial-")
        os.close(fd)
        shutil.copyfile(output, partial)
        os.replace(partial, kept)  # atomic: a concurrent compile of the same key writes the same bytes
    return status


if __name__ == "__main__":
    sys.exit(main())
