# Two entry points on a fresh machine (see README): `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
# torch is the main required dependency; 2.13.0 is what CI runs (a CPU build where one is provided).
TORCH  ?= torch==2.13.0
TRITON ?= triton==3.9.0
BIN    := $(VENV)/bin
JOBS   ?= 2

.PHONY: setup demo test test-simd test-gpu lint bench smoke-newest-torch dist-check clean

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)

# Without an NVIDIA driver, torch comes from PyTorch's CPU wheel index: the default wheels pull
# several GB of CUDA libraries. Where that index cannot be reached (a quick probe, no pip retries),
# one line says so and pip resolves torch as usual. $(call cpu_torch,PIP,SPEC)
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
define cpu_torch
	@if ! command -v nvidia-smi >/dev/null 2>&1 && [ ! -e /proc/driver/nvidia ]; then \
	  if $(PYTHON) -c "import urllib.request as u; u.urlopen('$(TORCH_CPU_INDEX)/torch/', timeout=10)" >/dev/null 2>&1; then \
	    echo "no NVIDIA driver: $(2) from PyTorch's CPU index"; \
	    $(1) install -q --retries 0 --timeout 10 --index-url $(TORCH_CPU_INDEX) "$(2)"; \
	  else \
	    echo "note: no NVIDIA driver, but $(TORCH_CPU_INDEX) cannot be reached: $(2) from the usual index (its default wheels include CUDA's)"; \
	  fi; \
	fi
endef

$(VENV)/.installed: pyproject.toml | $(BIN)/activate
	$(BIN)/python -m pip install -q --upgrade pip
	$(call cpu_torch,$(BIN)/python -m pip,$(TORCH))
	$(BIN)/python -m pip install -q "$(TORCH)" "$(TRITON)"
	$(BIN)/python -m pip install -q -e ".[transformers,plot,test]"
	touch $@

# The native (C++) launch path of the norms: compiled once per torch/Python/source version into
# the user cache (~30 s on 2 cores); the Python path runs where it cannot be built.
CSRC := $(wildcard src/polykernel/csrc/*.cpp src/polykernel/csrc/*.h src/polykernel/csrc/ops/*.h)
$(VENV)/.native: $(VENV)/.installed $(CSRC)
	$(BIN)/python -m polykernel.backends.triton._native
	touch $@

setup: $(VENV)/.installed $(VENV)/.native

demo: setup  ## the main job: op/impl verdicts here, then a small Llama trained with and without polykernel
	$(BIN)/polykernel demo $(ARGS)

# --durations=25: CI's log lists the slowest tests (candidates for the `slow` mark, docs/testing.md).
test: setup  ## the CPU suite (Triton kernels through TRITON_INTERPRET=1)
	$(BIN)/python -m pytest -q -n $(JOBS) --timeout=900 --durations=25 tests

# CPUs differ: without AVX-512 (or AVX2) torch and numpy (under Triton's interpreter) take other
# SIMD paths, with other summation orders. The parity tests must hold on each: run them again with
# those paths off (numpy >= 2.4 names the levels X86_V3/X86_V4; older numpy the single features).
NPY_NO_AVX512 := AVX512F AVX512CD AVX512_SKX AVX512_CLX AVX512_CNL AVX512_ICL AVX512_SPR X86_V4
NPY_NO_AVX2   := $(NPY_NO_AVX512) AVX2 FMA3 X86_V3
# Each pass keeps its own Inductor cache: torch 2.13 does not key that cache by ATEN_CPU_CAPABILITY,
# and code compiled for one ISA and reloaded under another gave wrong values and crashes.
test-simd: setup  ## the parity tests again with the AVX-512, then the AVX2 paths of torch and numpy off
	TORCHINDUCTOR_CACHE_DIR="$(abspath $(VENV))/inductor-avx2" ATEN_CPU_CAPABILITY=avx2 NPY_DISABLE_CPU_FEATURES="$(NPY_NO_AVX512)" $(BIN)/python -m pytest -q -n $(JOBS) -k parity tests
	TORCHINDUCTOR_CACHE_DIR="$(abspath $(VENV))/inductor-default" ATEN_CPU_CAPABILITY=default NPY_DISABLE_CPU_FEATURES="$(NPY_NO_AVX2)" $(BIN)/python -m pytest -q -n $(JOBS) -k parity tests

.PHONY: test-fallbacks
test-fallbacks: setup  ## the CPU suite again with every private-API fallback forced (polykernel/_compat/)
	POLYKERNEL_COMPAT_FALLBACKS=1 $(BIN)/python -m pytest -q -n $(JOBS) --timeout=900 tests

# The GPU suite in parts that each end within ~8 min on one H200 (a device command is capped at
# 10): `make test-gpu PART=moe`, or `make test-gpu` for every part in turn. Each part reports its
# 15 slowest tests and stops any one test after GPU_TIMEOUT s. The last part, `rest`, is every
# test file the others do not name: no GPU test is left out when files are added.
GPU_TIMEOUT ?= 240
# the losses in two parts: as one, a fresh H200 ran all but the six fused preference files in 480 s
# (2026-12-05, benchmarks/results/h200-2026-12-05-thirteenth/)
GPU_PART_losses  := $(addprefix tests/ops/test_,cross_entropy.py fused_linear_cross_entropy.py ce_options.py kl_div.py jsd.py tvd.py fused_linear_jsd.py tied_head_grads.py)
GPU_PART_preference := $(addprefix tests/ops/test_,preference_losses.py $(foreach l,dpo orpo cpo simpo kto grpo,fused_linear_$(l)_loss.py))
GPU_PART_moe     := $(addprefix tests/ops/test_,moe_experts.py moe_router.py moe_experts_gpt_oss.py)
SERVING_OPS      := silu_and_mul gelu_and_mul fused_add_rms_norm_ rotary_embedding_ dynamic_quant_fp8 static_quant_fp8 rms_norm_quant_fp8
# the peers in a process of their own: a peer kernel that faults poisons the CUDA context, and every
# later test of the process errors (2026-12-04: sgl-kernel, a misaligned load)
GPU_PART_peers   := tests/backends/test_serving_peers.py
GPU_PART_serving := $(wildcard tests/ops/test_serving_*.py) $(foreach o,$(SERVING_OPS),tests/ops/test_$(o).py) $(addprefix tests/backends/test_,cuda_jit.py torch_compile.py)
GPU_PART_grads   := tests/ops/test_double_backward.py tests/ops/test_func_transforms.py
# the other op files in three parts: as one, 36 of their 105 tests ran in 480 s on a fresh H200
# (2026-12-05, benchmarks/results/h200-2026-12-05-eighth/): every impl's large parity per dtype
GPU_OPS_OTHER    := $(filter-out $(GPU_PART_losses) $(GPU_PART_preference) $(GPU_PART_moe) $(GPU_PART_serving) $(GPU_PART_grads),$(wildcard tests/ops/test_*.py))
# a to f and g to l apart: as one, their large parities took ~560 s or more on a fresh H100, dyt's
# cut after 240 s (2026-12-06, benchmarks/results/h100-2026-12-06-sixteenth/)
GPU_PART_norms   := $(filter $(foreach c,a b c d e f,tests/ops/test_$(c)%),$(GPU_OPS_OTHER))
GPU_PART_norms3  := $(filter $(foreach c,g h i j k l,tests/ops/test_$(c)%),$(GPU_OPS_OTHER))
GPU_PART_edge    := $(addprefix tests/ops/test_,nonfinite_inputs.py moe_error_model.py moe_paths.py mrope.py)
# from ro (rope) to z apart: with the m to r files, 11 of their 26 tests ran in 480 s on a fresh H200
# (2026-12-06, benchmarks/results/h200-2026-12-06-seventeenth/)
GPU_PART_norms4  := $(filter $(foreach c,ro s t u v w x y z,tests/ops/test_$(c)%),$(GPU_OPS_OTHER))
GPU_PART_norms2  := $(filter-out $(GPU_PART_norms) $(GPU_PART_norms3) $(GPU_PART_edge) $(GPU_PART_norms4),$(GPU_OPS_OTHER))
GPU_PART_backends := $(filter-out $(GPU_PART_serving) $(GPU_PART_peers),$(wildcard tests/backends/test_*.py)) tests/core tests/tuning
# the GPU parity properties apart: every impl's compiles for each new shape (the rest of the part
# and 7 of them ran in 420 s on a fresh H200, 2026-12-05)
GPU_PART_parity  := tests/reliability/test_reliability_parity.py
GPU_PART_reliability := $(filter-out $(GPU_PART_parity),$(wildcard tests/reliability/test_*.py))
# Inductor on CUDA for every op apart: with the rest of the part, 66 of its 106 tests/compile GPU
# tests ran in 347 s on a warm H200 and the part was cut (2026-12-06, the seventeenth run's results)
GPU_PART_compile := tests/compile/test_compile.py
GPU_PART_models  := $(filter-out $(GPU_PART_compile),$(wildcard tests/compile/test_*.py)) tests/integrations tests/distributed tests/tools
GPU_PARTS        := norms norms3 norms2 norms4 edge grads losses preference moe serving peers backends reliability parity compile models rest
GPU_PART_rest    := $(filter-out $(foreach p,$(filter-out rest,$(GPU_PARTS)),$(GPU_PART_$(p))) $(foreach d,core tuning reliability compile integrations distributed tools,tests/$(d)/%),$(wildcard tests/test_*.py tests/*/test_*.py))
PART ?=

.PHONY: test-gpu-parts $(addprefix test-gpu-,$(GPU_PARTS))
test-gpu: $(if $(PART),test-gpu-$(PART),$(addprefix test-gpu-,$(GPU_PARTS)))  ## on a CUDA machine: every part, or PART=one of GPU_PARTS

test-gpu-parts:  ## list the GPU suite's parts and their files
	@$(foreach p,$(GPU_PARTS),echo "$(p): $(or $(GPU_PART_$(p)),(none))";)

$(addprefix test-gpu-,$(GPU_PARTS)): test-gpu-%:
	$(if $(strip $(GPU_PART_$*)),PK_FAILURES_NOW=1 PYTHONPATH=src$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) -m pytest -v -p no:cacheprovider -m "gpu or gpu2" --timeout=$(GPU_TIMEOUT) --durations=15 -rfEs $(GPU_PART_$*),@echo "test-gpu-$*: no files")

lint: setup  ## style, formatting, and the core's one-way import layers ([tool.importlinter] in pyproject.toml)
	$(BIN)/ruff check src tests benchmarks && $(BIN)/ruff format --check src tests benchmarks
	$(BIN)/lint-imports

bench:  ## on a CUDA machine: polykernel next to eager, torch.compile and installed peers
	PYTHONPATH=src $(PYTHON) -m polykernel bench $(ARGS)

# CI pins torch (TORCH above); users get the newest. A fresh venv with the newest torch pip
# resolves (unpinned; this machine image caps it in /etc/xdg/pip), the Triton it pins, and the
# test extras; then the native build, required to build and be usable with that Triton (CPU-only:
# no driver check), and the parts of the suite a new torch breaks first (dispatch, an op through
# Triton's interpreter, the native path's CPU tests, torch.compile). Under 6 min on 2 cores.
NEWEST       ?= .venv-newest
SMOKE_TESTS  ?= tests/core/test_spec.py tests/core/test_dispatch.py tests/ops/test_rms_norm.py tests/backends/test_native.py tests/compile/test_compile.py
smoke-newest-torch:  ## the newest torch release in a second venv: install, the native build, a short subset of the suite
	rm -rf $(NEWEST)
	$(PYTHON) -m venv $(NEWEST)
	$(NEWEST)/bin/python -m pip install -q --upgrade pip
	$(call cpu_torch,$(NEWEST)/bin/python -m pip,torch)
	$(NEWEST)/bin/python -m pip install -q torch triton numpy -e ".[test]"  # numpy: Triton's CPU interpreter
	$(NEWEST)/bin/python -c "import torch, triton; print('newest torch', torch.__version__, 'triton', triton.__version__)"
	POLYKERNEL_NATIVE=1 $(NEWEST)/bin/python -m polykernel.backends.triton._native
	$(NEWEST)/bin/python -m pytest -q -n $(JOBS) --timeout=600 $(SMOKE_TESTS)

# What a user installs: the sdist and the wheel (`twine check`), the wheel in a fresh venv with
# its dependencies but torch (import polykernel and polykernel.spec need no torch; the CLI's --help
# none either), imported from outside the clone so that src/ cannot stand in for it.
DIST_VENV ?= .venv-dist
BUILD     ?= $(BIN)/python -m build
TWINE     ?= $(BIN)/python -m twine
dist-check: setup  ## build the sdist and wheel, twine check them, install the wheel in a fresh venv and run it there
	rm -rf dist $(DIST_VENV)
	$(BUILD) --sdist --wheel --outdir dist .
	$(TWINE) check --strict dist/*
	$(PYTHON) -m venv $(DIST_VENV)
	$(DIST_VENV)/bin/python -m pip install -q --no-deps dist/*.whl
	$(DIST_VENV)/bin/python -c "from importlib.metadata import requires; print('\n'.join(r for r in requires('polykernel') if 'extra ==' not in r and not r.startswith('torch')))" > $(DIST_VENV)/deps.txt
	$(DIST_VENV)/bin/python -m pip install -q -r $(DIST_VENV)/deps.txt
	cd / && $(abspath $(DIST_VENV))/bin/python -c "import sys, polykernel, polykernel.spec; assert 'torch' not in sys.modules; print('wheel:', polykernel.__file__, polykernel.__version__)"
	cd / && $(abspath $(DIST_VENV))/bin/polykernel --help > /dev/null

clean:
	rm -rf $(VENV) $(NEWEST) $(DIST_VENV) build dist *.egg-info src/*.egg-info .pytest_cache
