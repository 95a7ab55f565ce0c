# Two entry points on a fresh machine (see README): `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
# torch is the only required dependency; 2.13.0 is what CI runs (a CPU build where one is provided).
TORCH  ?= torch==2.13.0
TRITON ?= triton==3.9.0
BIN    := $(VENV)/bin
JOBS   ?= 2

.PHONY: setup demo test test-gpu lint bench clean

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/activate
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)" "$(TRITON)"
	$(BIN)/python -m pip install -q -e ".[transformers,test]"
	touch $@

setup: $(VENV)/.installed

demo: setup  ## the main job: op/impl verdicts here, then a small Llama trained with and without polykernel
	$(BIN)/polykernel demo $(ARGS)

test: setup  ## the CPU suite (Triton kernels through TRITON_INTERPRET=1)
	$(BIN)/python -m pytest -q -n $(JOBS) --timeout=900 tests

test-gpu:  ## on a CUDA machine with torch and triton installed
	PYTHONPATH=src $(PYTHON) -m pytest -q -m "gpu or gpu2" tests

lint: setup  ## style, formatting, and the core's one-way import layers ([tool.importlinter] in pyproject.toml)
	$(BIN)/ruff check src tests benchmarks && $(BIN)/ruff format --check src tests benchmarks
	$(BIN)/lint-imports

bench:  ## on a CUDA machine: polykernel next to eager, torch.compile and installed peers
	PYTHONPATH=src $(PYTHON) -m polykernel bench $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
