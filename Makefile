# Two front doors for a fresh machine (Python 3.11+, no GPU needed):
#   make run    set everything up, then run the main job (the default pipeline, tiny preset, CPU, offline)
#   make test   set everything up, then run the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup run test clean

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

clean:
	rm -rf data runs artifacts metrics plots
