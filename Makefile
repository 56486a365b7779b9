# crowdtrain: `make demo` runs the example job; `make test` runs the whole suite, ruff and mypy included
# (tests/test_code_health.py), and lists its 15 slowest tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install bench compose-test compose-prerequisites docs docs-reference clean

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
# Both passes always run, a failure in the first included; the last two lines say how each ended, and
# `make test` fails if either failed.
TEST_WORKERS ?= 4
PYTEST := $(PY) -m pytest -ra -p no:cacheprovider
PARALLEL_PASS := $(PYTEST) --durations=15 -n $(TEST_WORKERS) --dist worksteal -m "not serial" $(PYTEST_ARGS)
SERIAL_PASS := $(PYTEST) -m serial $(PYTEST_ARGS)

test: $(STAMP)
	@echo "make test: parallel pass, $(TEST_WORKERS) workers, -m 'not serial'"; parallel=0; $(PARALLEL_PASS) || parallel=$$?; \
	echo "make test: serial pass, -m serial"; serial=0; $(SERIAL_PASS) || serial=$$?; \
	outcome() { case $$2 in 0) echo "make test: $$1 pass passed";; \
		5) if [ $$1 = serial ]; then echo "make test: serial pass ran no test (pytest exit 5, accepted)"; \
		   else echo "make test: $$1 pass failed (pytest exit 5)"; fi;; \
		*) echo "make test: $$1 pass failed (pytest exit $$2)";; esac; }; \
	outcome parallel $$parallel; outcome serial $$serial; \
	[ $$parallel -eq 0 ] && { [ $$serial -eq 0 ] || [ $$serial -eq 5 ]; }

# docker-compose.yml built and run by a real Docker engine, on a local Debian base image (docs/operator/deploy.md):
# root, docker.io, docker-compose and debootstrap needed. Not part of `make test` or .ci/run: it takes as long.
# What it needs is checked first, before .venv is made: installed with apt-get as root on Debian
# (COMPOSE_TEST_INSTALL=no forbids it), otherwise named with the command that installs it.
compose-test: compose-prerequisites $(STAMP)
	PIP=$(VENV)/bin/pip PYTHON=$(PY) tests/compose/compose-test.sh

compose-prerequisites:
	tests/compose/compose-test.sh --prerequisites

# The manual (docs/, mkdocs.yml) built into var/site; `.venv/bin/mkdocs serve` shows it while editing.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict

# The job spec's reference page, rendered from its schema; tests/crowdtrain/core/test_spec_reference.py fails when
# the committed page is stale.
docs-reference: $(STAMP)
	$(PY) -m crowdtrain.core.spec_reference docs/reference/job-spec.md

bench: $(STAMP)
	$(PY) benchmarks/merge_latency.py

clean:
	rm -rf var .pytest_cache .mypy_cache .ruff_cache
