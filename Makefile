# Set-up and tests in one command each; the venv is (re)built when its recipe changes.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup test demo bench lint
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

lint: setup
	$(PY) -m ruff check .
