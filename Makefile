# Set-up and tests in one command each; the venv is (re)built when its recipe changes.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup test test-fast demo bench lint gpu-check gpu-bundle gpu-rehearse te test-hf-versions test-versions lock-refresh
setup: $(VENV)/.installed

# requirements.lock pins every package (the versions the suite last passed with).
$(VENV)/.installed: pyproject.toml requirements.lock scripts/install.sh
	bash scripts/install.sh $(VENV)
	touch $@

# Two workers (pytest-xdist), each taking whole test modules, heaviest first (tests/scheduling.py);
# TEST_WORKERS=0 runs in this process alone. The 25 slowest tests close the report, so every
# run shows where the suite's time goes.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=25

# The fast tier for the edit loop (< 3 minutes on a 2-core CPU): no test that starts a process,
# needs a GPU or a cluster (tests/tiers.py holds the markers to that).
test-fast: setup
	$(PY) -m pytest -q -m "not slow and not gpu and not cluster"

demo: setup
	PYTHON=$(PY) bash scripts/demo.sh

bench: setup
	$(PY) -m bench.schemes

# Before a GPU loan, on a CPU machine with PyPI: the wheels the GPU machine lacks (checked);
# prints what the run carries and the command it runs (bench/gpu_check/bundle.py).
BUNDLE ?= gpu-bundle
gpu-bundle: setup
	$(PY) -m bench.gpu_check.bundle --out $(BUNDLE)

# On the GPU machine (no network; its own python3 has CUDA torch, no venv): the bundle's wheels,
# then the check in priority order within 8 minutes, each part's JSON in $OUT (else
# runs/gpu-check).
GPU_PYTHON ?= python3
gpu-check:
	$(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $(BUNDLE)/site $(BUNDLE)/*.whl
	PYTHONPATH=$(CURDIR)/$(BUNDLE)/site:$(CURDIR) $(GPU_PYTHON) -m bench.gpu_check --bundle $(BUNDLE)

# The same check on the CPU at tiny shapes (Triton's interpreter): a few minutes.
gpu-rehearse: setup
	$(PY) -m bench.gpu_check --rehearse

# On a GPU node only: Transformer Engine built against the venv's CUDA torch.
te: setup
	bash scripts/install_te.sh $(VENV)

# Exported folders against the oldest and the newest supported transformers, each in its own
# venv (.venv-hf/<version>: torch and that release only).
test-hf-versions: setup
	$(PY) scripts/test_hf_versions.py

# The version-sensitive tests (kernels, opcheck, compiled blocks, equations, the GPU check's
# rehearsal, CLI smoke runs) under the GPU image's torch 2.11.0 + triton 3.6.0 and the newest torch
# on the index, each in its own venv (.venv-versions/<name>, built once); not part of `make test`.
test-versions: setup
	$(PY) scripts/test_versions.py

# The newest releases pyproject allows, tested with the whole suite before they become the lock.
lock-refresh:
	bash scripts/refresh_lock.sh

lint: setup
	$(PY) -m ruff check .
