#!/usr/bin/env bash
# Create a virtual environment and install the project with everything it needs.
# Usage: scripts/install.sh [VENV_DIR]   (default .venv)
# TORCH_SPEC picks the torch build (default torch==2.13.0, the CPU wheel on our machines;
# on a GPU machine set it to the CUDA build you use). Transformer Engine is the optional
# extra `te` and must only be installed where CUDA exists.
set -euo pipefail
venv=${1:-.venv}
python3 -m venv "$venv"
pip() { "$venv/bin/python" -m pip --disable-pip-version-check "$@"; }
pip install -q "${TORCH_SPEC:-torch==2.13.0}"
# megatron-core 0.19.2's metadata asks for Python >= 3.12; its cp311 wheel works on 3.11.
pip install -q --no-deps --ignore-requires-python "megatron-core==0.19.2"
pip install -q -e ".[dev,demo,sweep,eval]"
