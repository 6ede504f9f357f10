# fleetwise: two commands do everything on a fresh machine.
#   make demo   create .venv, install, run the demo job
#   make test   create .venv, install with test extras, run the tests
#
# torch is installed first, pinned (TORCH_SPEC), so that pip takes a local CPU wheel where one
# exists (pip's find-links / constraints) and never resolves an unpinned `torch` to a multi-GB CUDA
# build. Elsewhere the same pin gets the usual PyPI build; pick another with e.g.
#   make test TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"

PYTHON     ?= $(shell command -v python3.11 || command -v python3)
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY         := $(VENV)/bin/python
STAMP      := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install demo test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check $(TORCH_SPEC)
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[test]"
	touch $@

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/fleetwise plan recipe=gpt/gpt3_1.3b

test: $(STAMP)
	$(VENV)/bin/pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check platform tests scripts

clean:
	rm -rf $(VENV) outputs multirun mlruns mlflow.db dist .pytest_cache
