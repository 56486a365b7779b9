# crowdtrain: `make demo` runs the example job; `make test` runs the whole suite, ruff and mypy included
# (tests/test_code_health.py), and lists its 15 slowest tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install bench compose-test clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip

# torch is pinned first: with 2.13.0 installed, the project's `torch>=2.3` pulls nothing more.
# The dev extra brings tensorflow too; it installs beside that torch and keeps numpy as it is.
$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m crowdtrain demo

# Tests run on $(TEST_WORKERS) xdist workers, each taking the next test as it frees up: most tests wait on
# the processes they start, so more workers than cores pay (TEST_WORKERS=0 runs them in one process).
# Tests marked `serial` judge the machine's own load: they run after the others, alone, in a second pass
# (which may find none when PYTEST_ARGS selects a few tests: pytest's exit 5 is accepted there only).
TEST_WORKERS ?= 4
PYTEST := $(PY) -m pytest -ra -p no:cacheprovider

test: $(STAMP)
	$(PYTEST) --durations=15 -n $(TEST_WORKERS) --dist worksteal -m "not serial" $(PYTEST_ARGS)
	$(PYTEST) -m serial $(PYTEST_ARGS) || [ $$? -eq 5 ]

# docker-compose.yml built and run by a real Docker engine, on a local Debian base image (README, Deploy):
# root, docker.io, docker-compose and debootstrap needed. Not part of `make test` or .ci/run: it takes as long.
compose-test: $(STAMP)
	PIP=$(VENV)/bin/pip PYTHON=$(PY) tests/compose/compose-test.sh

bench: $(STAMP)
	$(PY) benchmarks/merge_latency.py

clean:
	rm -rf var .pytest_cache .mypy_cache .ruff_cache
