# Set-up and tests in one command each; the venv is (re)built when its recipe changes.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup test demo bench lint gpu-check te
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/install.sh
	bash scripts/install.sh $(VENV)
	touch $@

test: setup
	$(PY) -m pytest -q

demo: setup
	PYTHON=$(PY) bash scripts/demo.sh

bench: setup
	$(PY) -m bench.schemes

# On a GPU node: the GPU-only tests (the rest run in `make test`), then the GPU benchmarks.
gpu-check: setup
	$(PY) -m pytest -q -m gpu -rs
	$(PY) -m bench.fused_norms
	$(PY) -m bench.saved_activations
	$(PY) -m bench.gpu_step --profile 3

# On a GPU node only: Transformer Engine built against the venv's CUDA torch.
te: setup
	bash scripts/install_te.sh $(VENV)

lint: setup
	$(PY) -m ruff check .
