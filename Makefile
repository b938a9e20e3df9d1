# Front doors for a fresh machine (Python 3.11+, no GPU needed):
#   make run    set everything up, then run the main job: the DVC pipeline on the tiny preset (CPU, offline)
#   make test   set everything up, then run the whole test suite (what CI runs, with make lint)
#   make test-fast  the unit tests only (no end-to-end runs of DVC, Prefect, MLflow servers, torchrun)
#   make lint   ruff check and ruff format --check
#   make params rewrite params.yaml's comments from the knobs' docs in laplace/config.py (values kept)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export PATH := $(abspath $(BIN)):$(PATH)
export DVC_NO_ANALYTICS := 1
PREFECT_PORT ?= 4200
MLFLOW_PORT ?= 5000
export PREFECT_HOME ?= $(abspath .prefect)

.PHONY: setup run test test-fast lint format params clean prefect-server prefect-worker prefect-deploy mlflow-ui

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# the CPU wheel of torch first, so the resolver never pulls a CUDA build
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

run: setup
	$(BIN)/laplace run

test: setup
	$(BIN)/python -m pytest -q

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

params: setup
	$(BIN)/python -m laplace.pipeline.params params.yaml

# Prefect: a local server, a process work pool with its worker, and the deployments of prefect.yaml.
prefect-server: setup
	$(BIN)/prefect server start --host 127.0.0.1 --port $(PREFECT_PORT)

prefect-worker: setup
	PREFECT_API_URL=http://127.0.0.1:$(PREFECT_PORT)/api $(BIN)/prefect work-pool create laplace --type process --overwrite
	PREFECT_API_URL=http://127.0.0.1:$(PREFECT_PORT)/api $(BIN)/prefect --no-prompt deploy --all
	PREFECT_API_URL=http://127.0.0.1:$(PREFECT_PORT)/api $(BIN)/prefect worker start --pool laplace

# MLflow UI on the project's store (artifacts are served from mlartifacts/).
mlflow-ui: setup
	$(BIN)/mlflow ui --backend-store-uri sqlite:///$(abspath mlflow.db) --host 127.0.0.1 --port $(MLFLOW_PORT)

clean:
	rm -rf data runs artifacts metrics plots dvc_plots
