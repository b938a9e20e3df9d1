"""`lm_eval --model laplace` without changing lm-eval: the .pth hook registers the model lazily and
leaves lm-eval's own models as they were. Each case runs in a fresh interpreter started with -S
(no site: the venv's own .pth files, ours included, do not run), given the venv's packages and
this checkout by path, so the hook under test is the only one."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from laplace.evals import lm_eval_plugin

pytest.importorskip("lm_eval", reason="lm-eval is the optional extra laplace[eval] (in dev)")

ROOT = Path(__file__).resolve().parents[1]


def bare_python(code: str) -> str:
    paths = [sysconfig.get_paths()["purelib"], str(ROOT)]
    done = subprocess.run(
        [sys.executable, "-S", "-c", f"import sys; sys.path += {paths!r}; {code}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_without_the_hook_lm_eval_does_not_know_laplace():
    code = "from lm_eval.api.registry import get_model, model_registry; import lm_eval.models; "
    code += "print('laplace' in model_registry, 'dummy' in model_registry)"
    assert bare_python(code) == "False True"  # what the hook is for


def test_the_pth_line_registers_laplace_beside_lm_evals_own_models(tmp_path):
    pth = lm_eval_plugin.install_pth(tmp_path)
    assert pth.read_text() == lm_eval_plugin.PTH_LINE and pth.name == "laplace_lm_eval.pth"
    code = (
        f"import site; site.addsitedir({str(tmp_path)!r}); "
        "print('lm_eval' in sys.modules, 'laplace.evals.harness' in sys.modules); "
        "from lm_eval.api.registry import get_model; "
        "print(get_model('laplace').__name__, get_model('dummy').__name__, 'laplace.evals.harness' in sys.modules)"
    )
    before, after = bare_python(code).splitlines()
    assert before == "False False"  # nothing of lm-eval or the harness is imported at startup
    assert after == "LaplaceHarnessLM DummyLM True"


def test_install_after_lm_eval_was_imported_registers_at_once():
    code = (
        "import lm_eval.api.registry as r; print('laplace' in r.model_registry); "
        "from laplace.evals import lm_eval_plugin as p; p.install(); "
        "print(r.get_model('laplace').__name__, r.get_model('dummy').__name__)"
    )
    assert bare_python(code).splitlines() == ["False", "LaplaceHarnessLM DummyLM"]


# lm-eval's get_model loads its own models only into an empty registry: the harness module's
# `@register_model("laplace")` at import must not leave `laplace` alone there, whichever comes first
# (the script: the harness imported, then simple_evaluate(model="local-completions")).
ORDERS = {
    "harness first": "import laplace.evals.harness; import lm_eval.api.registry as r",
    "lm-eval's registry first": "import lm_eval.api.registry as r; import laplace.evals.harness",
}


@pytest.mark.parametrize("order", ORDERS)
def test_importing_the_harness_in_any_order_keeps_lm_evals_own_models(order):
    code = ORDERS[order] + "; print(*(r.get_model(m).__name__ for m in ('local-completions', 'hf', 'laplace')))"
    assert bare_python(code) == "LocalCompletionsAPI HFLM LaplaceHarnessLM"
