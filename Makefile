# fleetwise: two commands do everything on a fresh machine.
#   make demo   create .venv, install, run the demo job
#   make test   create .venv, install with test extras, run the tests
#   make check  the fast loop while you work: unit tests + one 2-rank job (a few minutes)
#   make durations  the whole suite, then tests/DURATIONS.md (seconds per test file; commit it)
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
# Test files run TEST_WORKERS at a time (pytest-xdist, one file per worker so that module fixtures
# such as the parity references run once). Most tests start a few CPU processes whose start-up
# (torch imports, rendezvous) and single-process dry runs leave a core idle; on 2 cores two workers
# ran the dry-run table 1.47x faster. Three ran the whole suite no faster than two (805 s against
# 793 s back to back on 2026-11-30, both cores 98% busy against 91%). Files go to the workers
# longest first, by tests/DURATIONS.md (tests/conftest.py; xdist's own order, by number of tests,
# ran its one-minute one-test files last). TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2
XDIST       := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

.PHONY: install demo readme-demo test check test-under-load durations test-torch lint bench clean gpu-wheelhouse

# pip compiles every installed module to bytecode one file at a time (73 s of a 139 s install here);
# compileall does it on every core (48 s on 2): the suite's processes then read bytecode, also where
# PYTHONDONTWRITEBYTECODE keeps them from writing it. As under pip, a file that does not compile (torch
# ships one in a newer Python's syntax) is not an error: it would fail only where imported.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-compile $(TORCH_SPEC)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-compile -e ".[test]"
	$(PY) -m compileall -q -j 0 $(VENV)/lib > /dev/null || true
	touch $@

install: $(STAMP)

# fleetwise's own modules (an editable install) and the tests' helpers to bytecode before every run
# that starts processes: where PYTHONDONTWRITEBYTECODE is set (this machine), a new interpreter
# compiled them from source every time (0.2-0.5 s of CPU a `fleetwise` process; 9% of a two-host
# test's CPU). Python checks each file's timestamp, so an edited module is never read stale.
OWN_BYTECODE = $(PY) -m compileall -q -j 0 platform tests scripts examples > /dev/null || true

# The demo: a tiny GPT on a 4D layout (pipeline 2 × ZeRO-2 sharding 2 × tensor parallel 2 = 8 ranks),
# each rank a CPU process, gloo collectives, ~1 minute, learning to write Python: its data is the
# standard library's own source text (data=bundled, no download).
DEMO ?= recipe=gpt/tiny data=bundled strategy=hybrid strategy.pp_degree=2 strategy.sharding_degree=2 \
        strategy.sharding_stage=2 strategy.mp_degree=2 train.steps=30

demo: $(STAMP)
	@$(OWN_BYTECODE)
	$(VENV)/bin/fleetwise plan $(DEMO)
	$(VENV)/bin/fleetwise train $(DEMO)

# Run the demo in a temporary directory and paste its summary into README.md (scripts/readme_demo.py).
readme-demo: $(STAMP)
	@$(OWN_BYTECODE)
	$(PY) scripts/readme_demo.py $(DEMO)

test: $(STAMP)
	@$(OWN_BYTECODE)
	$(VENV)/bin/pytest $(XDIST) $(PYTEST_ARGS)

# Unit tests (no process started) and one real 2-rank job; `make test` is the whole suite (CI).
check: $(STAMP)
	@$(OWN_BYTECODE)
	$(VENV)/bin/pytest $(XDIST) -m "not slow or smoke" $(PYTEST_ARGS)

# The suite on a busy machine, as on a shared CI runner: two CPU-bound processes run beside it for
# its whole duration (the suite has no tight wall-clock asserts and must pass this way too).
test-under-load: $(STAMP)
	@$(OWN_BYTECODE)
	@$(PY) -c "while True: pass" & a=$$!; $(PY) -c "while True: pass" & b=$$!; \
	trap 'kill $$a $$b 2>/dev/null' EXIT INT TERM; \
	echo "two CPU-bound load processes: $$a $$b"; $(VENV)/bin/pytest $(XDIST) $(PYTEST_ARGS)

# The whole suite, then tests/DURATIONS.md: seconds per test file, slowest first, with the total, the
# machine, its load and the date (scripts/durations.py). Commit the table: a file that got slower
# shows in review. Run it on an otherwise idle machine.
DURATIONS_XML ?= build/junit.xml
durations: $(STAMP)
	@mkdir -p $(dir $(DURATIONS_XML))
	@$(OWN_BYTECODE)
	@load="$$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null)"; start=$$(date +%s); \
	$(VENV)/bin/pytest $(XDIST) --junitxml=$(DURATIONS_XML) $(PYTEST_ARGS); rc=$$?; \
	$(PY) scripts/durations.py $(DURATIONS_XML) --wall $$(( $$(date +%s) - start )) \
	  $(if $(XDIST),--workers $(TEST_WORKERS)) --load "$$load" $(if $(PYTEST_ARGS),--selection '$(PYTEST_ARGS)') \
	  > tests/DURATIONS.md; \
	echo "tests/DURATIONS.md written"; exit $$rc

# fleetwise on another torch (scripts/test_torch.py): make check's tests, one real job per engine and a
# pipelined dry run, in a venv of its own (never $(VENV), the CI pin), with a pass/fail table:
#   make test-torch TORCH_SPEC=torch==2.11.0          a new .venv-torch-2.11.0 (torch first, then fleetwise[test])
#   make test-torch TORCH_VENV=/path/to/venv          an existing venv, with whatever torch it has
TORCH_VENV ?=
test-torch:
	$(PYTHON) scripts/test_torch.py --workers $(TEST_WORKERS) \
	  $(if $(TORCH_VENV),--venv $(TORCH_VENV)) \
	  $(if $(and $(TORCH_VENV),$(filter file,$(origin TORCH_SPEC))),,--torch-spec "$(TORCH_SPEC)")

lint: $(STAMP)
	$(VENV)/bin/ruff check platform tests scripts

clean:
	rm -rf $(VENV) outputs multirun mlruns mlartifacts mlflow.db dist .pytest_cache

# Benchmarks (scripts/bench.py): overhead vs plain PyTorch, compute efficiency, pipeline bubble,
# planner accuracy, start-up (+ GPU where CUDA exists). Writes bench/results.json and results.md.
bench: $(STAMP)
	$(VENV)/bin/python scripts/bench.py

# The wheels a bare GPU machine (torch preinstalled, no network) needs for scripts/gpu_check.sh:
# fleetwise and what it imports beyond torch and the image's packages, for Python 3.12 manylinux
# x86-64 (never torch), into .whl/ (git-ignored), under 64 MiB with the working tree (the build
# prints the total and fails over it). GPU_WHEELHOUSE_MLFLOW=0 leaves MLflow out (the check's
# tracking step is then skipped). scripts/gpu_wheelhouse.py says what is carried and why.
GPU_WHEELHOUSE_MLFLOW ?= 1
gpu-wheelhouse: $(STAMP)
	$(PY) scripts/gpu_wheelhouse.py .whl $(if $(filter 0,$(GPU_WHEELHOUSE_MLFLOW)),--no-mlflow,)
