# Set-up and tests in one command each; the venv is (re)built when its recipe changes.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup test test-fast demo bench lint gpu-check te test-hf-versions lock-refresh
setup: $(VENV)/.installed

# requirements.lock pins every package (the versions the suite last passed with).
$(VENV)/.installed: pyproject.toml requirements.lock scripts/install.sh
	bash scripts/install.sh $(VENV)
	touch $@

# The 25 slowest tests close the report, so every run shows where the suite's time goes.
test: setup
	$(PY) -m pytest -q --durations=25

# The fast tier for the edit loop (< 3 minutes on a 2-core CPU): no test that starts a process,
# needs a GPU or a cluster (tests/tiers.py holds the markers to that).
test-fast: setup
	$(PY) -m pytest -q -m "not slow and not gpu and not cluster"

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

# Exported folders against the oldest and the newest supported transformers, each in its own
# venv (.venv-hf/<version>: torch and that release only).
test-hf-versions: setup
	$(PY) scripts/test_hf_versions.py

# The newest releases pyproject allows, tested with the whole suite before they become the lock.
lock-refresh:
	bash scripts/refresh_lock.sh

lint: setup
	$(PY) -m ruff check .
