# The two ways to start: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch 2.13.0 (on disk on our machines). With a GPU, install a CUDA build into
# .venv first (see README); the project's own range then accepts it and nothing is replaced.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test lint format bench-dht clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[dev,hivemind,ray]"
	touch $@

demo: $(BIN)/.installed
	$(BIN)/peer demo

# Most tests wait on sockets, timeouts and other processes rather than compute, so the suite
# runs on more workers than cores; tests that share a machine-wide resource run in one group,
# and the few that read the host's timing closely run afterwards, alone (tests/conftest.py).
# PYTEST_WORKERS=0 runs the first part in one process too. -rs names every skipped test and why.
# Four workers keep both cores busy (97% over the first part, which took 12:56 and 13:51 on
# 2026-11-29 against 15:44-17:36 with three).
PYTEST_WORKERS ?= 4
test: $(BIN)/.installed lint
	$(BIN)/python -m pytest -q -rs -n $(PYTEST_WORKERS) --dist loadgroup -m "not serial" --durations=40
	$(BIN)/python -m pytest -q -rs -m serial

lint: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(BIN)/.installed
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# The native and hivemind backends side by side (an hour or more on 2 cores); Markdown tables for
# docs/BENCHMARKS.md go to $(BENCH_OUT). BENCH_ARGS narrows the sweep (see peer bench compare -h).
BENCH_OUT ?= bench-results.md
BENCH_ARGS ?=
.PHONY: bench
bench: $(BIN)/.installed
	$(BIN)/peer bench compare --out $(BENCH_OUT) $(BENCH_ARGS)

bench-dht: $(BIN)/.installed
	$(BIN)/peer bench dht --nodes 64 --json

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
