# Front doors for a fresh machine (Python 3.11+, no GPU needed):
#   make run    install the runtime set, then run the main job: the DVC pipeline on the tiny preset (CPU, offline)
#   make compare  the architecture comparison: pure GLA, hybrids and softmax side by side (docs/architectures.md)
#   make test   install the dev set (the runtime, test oracles, pytest), then run the whole test suite (CI: with make lint)
#   make test-fast  the unit tests only (no end-to-end runs of DVC, Prefect, MLflow servers, torchrun)
#   make lint   ruff check and ruff format --check
#   make params rewrite params.yaml's comments from the knobs' docs in laplace/config/ (values kept)
#   make stop   stop the servers started by make mlflow-ui / prefect-server / prefect-worker, and their flow runs
# The venv's interpreter: PYTHON when given, else the distribution's /usr/bin/python3 where it is
# 3.11+ with venv, else python3 on PATH. The distribution's first: version managers (pyenv, asdf)
# build CPython from source as a shared library without PGO or LTO by default, and most of the
# suite's time (and of warmup and serve-check) is torch.compile's compile step, which is pure
# Python: the same compile took 1.3-1.4x the time under pyenv's 3.11.7 as under Debian's 3.11.2 on
# one machine (docs/testing.md). `make setup PYTHON=python3.12` picks another.
SYSTEM_PYTHON := /usr/bin/python3
PYTHON ?= $(shell $(SYSTEM_PYTHON) -c 'import sys, ensurepip, venv; sys.exit(sys.version_info < (3, 11))' \
	>/dev/null 2>&1 && echo $(SYSTEM_PYTHON) || echo python3)
VENV ?= .venv
BIN := $(VENV)/bin
export PATH := $(abspath $(BIN)):$(PATH)
# no usage reports from DVC, MLflow or the Prefect server (the tests turn them off the same way)
export DVC_NO_ANALYTICS := 1
export MLFLOW_DISABLE_TELEMETRY := true
export PREFECT_SERVER_ANALYTICS_ENABLED := false
PREFECT_PORT ?= 4200
MLFLOW_PORT ?= 5000
export PREFECT_HOME ?= $(abspath .prefect)

.PHONY: setup run compare test test-fast lint format params clean prefect-server prefect-worker prefect-ready mlflow-ui stop

# Two installs: `setup` (make test, lint) is the dev set, `.[dev]`: the runtime plus the test
# oracles (flash-linear-attention, triton, transformers, lm_eval, openai, accelerate) and pytest,
# ruff. `make run` and the servers need only the runtime set, `.`.
# A runtime venv upgrades to dev at the first make test; a dev venv is already a runtime one.
setup: $(VENV)/.installed
RUNTIME := $(VENV)/.runtime

# setuptools' "Editable installation." notice is a warning box in every make run's output: not shown
# the CPU wheel of torch first, so the resolver never pulls a CUDA build.
# --no-compile, then BYTE_COMPILE: pip byte-compiles the ~28,000 installed modules one at a time;
# compileall does it on every core (54 s here on 2 cores, against about 95 s). It must happen at
# setup: where PYTHONDONTWRITEBYTECODE is set (many containers, CI's machine), Python never writes
# a .pyc, so every process compiled every module it imported (import torch 4.9 s -> 2.1 s,
# torch._inductor 16 s -> 5.7 s, mlflow 7.9 s -> 2.4 s). Modules written for Pythons newer than
# the venv's (torch's py312_intrinsics, whenever's _typing_312) fail to compile and are skipped, as
# pip's own byte-compile skips them; -qq keeps their errors out of the setup's output.
PIP_INSTALL = $(BIN)/pip install --quiet --no-compile
BYTE_COMPILE = ( $(BIN)/python -m compileall -qq -j 0 \
	"$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" laplace || true )
INSTALL_BASE = $(PYTHON) -m venv $(VENV) && $(BIN)/pip install --quiet --upgrade pip && \
	$(PIP_INSTALL) torch==2.13.0
EDITABLE = PYTHONWARNINGS="ignore:Editable installation" $(PIP_INSTALL) -e

$(VENV)/.installed: pyproject.toml
	$(INSTALL_BASE)
	$(EDITABLE) '.[dev]'
	# `lm_eval --model laplace`: lm-eval has no plugin discovery (laplace/evals/lm_eval_plugin.py)
	$(BIN)/python -m laplace.evals.lm_eval_plugin
	$(BYTE_COMPILE)
	touch $@ $(RUNTIME)

# an up-to-date dev venv holds the runtime set: nothing to install
$(RUNTIME): pyproject.toml
	if [ $(VENV)/.installed -nt pyproject.toml ]; then touch $@; else $(INSTALL_BASE) && $(EDITABLE) . && $(BYTE_COMPILE) && touch $@; fi

run: $(RUNTIME)
	$(BIN)/laplace run

# the architecture comparison (docs/architectures.md): the project's token shards, then every arm and
# the table in compare/, a DVC repository of its own (the project's dvc status never lists its stages)
compare: $(RUNTIME)
	$(BIN)/dvc repro tokenize
	cd compare && dvc repro

# pytest-xdist workers: each test module (or the tiny_pipeline group) runs on one, the heaviest first by
# tests/durations.json (tests/conftest.py, docs/testing.md); TEST_WORKERS=0 runs in one process.
# PYTEST_ARGS=--record-durations rewrites that file from the run.
TEST_WORKERS ?= 2
PYTEST_PARALLEL := -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

test: setup
	$(BIN)/python -m pytest -q $(PYTEST_PARALLEL) $(PYTEST_ARGS)

test-fast: setup
	$(BIN)/python -m pytest -q $(PYTEST_PARALLEL) -m "not slow"

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

params: setup
	$(BIN)/python -m laplace.pipeline.params params.yaml

# Each background server records its make (the recipe shell's parent) first: `make stop` ends that
# make and every process under it, flow runs in sessions of their own included (laplace/pipeline/servers.py)
SERVERS_DIR := runs/servers
RECORD_SERVER = @mkdir -p $(SERVERS_DIR) && echo $$PPID > $(SERVERS_DIR)/$@.pid
# how long make stop gives each process to exit on SIGTERM before SIGKILL (seconds)
STOP_GRACE_S ?= 20

# Prefect: a local server, a process work pool with its worker, and the deployments of prefect.yaml.
prefect-server: $(RUNTIME)
	$(RECORD_SERVER)
	$(BIN)/prefect server start --host 127.0.0.1 --port $(PREFECT_PORT)

PREFECT_API := http://127.0.0.1:$(PREFECT_PORT)/api
# how long prefect-worker waits for the server and prefect-ready for the deployments (seconds), and
# the bound of each of their checks (one hangs while the server starts)
PREFECT_READY_S ?= 300
PREFECT_CHECK_S ?= 20
# Waits (up to 5 minutes) for the server, so it may be started right after prefect-server.
prefect-worker: $(RUNTIME)
	$(RECORD_SERVER)
	@end=$$(($$(date +%s) + $(PREFECT_READY_S))); while [ $$(date +%s) -lt $$end ]; do timeout $(PREFECT_CHECK_S) $(BIN)/python -c "import urllib.request as u; u.urlopen('$(PREFECT_API)/health', timeout=5)" 2>/dev/null && exit 0; sleep 2; done; echo "no Prefect server at $(PREFECT_API): run make prefect-server first" >&2; exit 1
	PREFECT_API_URL=$(PREFECT_API) $(BIN)/prefect work-pool create laplace --type process --overwrite
	PREFECT_API_URL=$(PREFECT_API) $(BIN)/prefect --no-prompt deploy --all
	PREFECT_API_URL=$(PREFECT_API) $(BIN)/prefect worker start --pool laplace

# Waits (up to PREFECT_READY_S, each check bounded by PREFECT_CHECK_S) until prefect-worker has
# created the deployments.
prefect-ready: $(RUNTIME)
	@end=$$(($$(date +%s) + $(PREFECT_READY_S))); while [ $$(date +%s) -lt $$end ]; do PREFECT_API_URL=$(PREFECT_API) timeout $(PREFECT_CHECK_S) $(BIN)/prefect deployment inspect 'laplace-pipeline/tiny' >/dev/null 2>&1 && exit 0; sleep 3; done; echo "no deployment laplace-pipeline/tiny at $(PREFECT_API) after $(PREFECT_READY_S) s: is make prefect-worker running?" >&2; exit 1

# MLflow UI on the project's store (artifacts are served from mlartifacts/): one uvicorn worker and
# no job runner (mlflow's defaults, 4 workers + a job runner + huey consumers, are 16 processes and
# ~3 GB for a local UI)
mlflow-ui: $(RUNTIME)
	$(RECORD_SERVER)
	MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false $(BIN)/mlflow ui --backend-store-uri sqlite:///$(abspath mlflow.db) --host 127.0.0.1 --port $(MLFLOW_PORT) --workers 1

# the MLflow UI, the Prefect server, the worker and its flow runs: SIGTERM, STOP_GRACE_S, then SIGKILL
stop:
	@$(BIN)/python -m laplace.pipeline.servers $(SERVERS_DIR) --grace-s $(STOP_GRACE_S)

clean:
	rm -rf data runs artifacts metrics plots dvc_plots
