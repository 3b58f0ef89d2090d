#!/usr/bin/env bash
# Create a virtual environment and install the project with everything it needs, at the
# versions of requirements.lock: the set the whole test suite last passed with.
# Usage: scripts/install.sh [VENV_DIR]   (default .venv)
#
# requirements.lock is a pip constraints file: it pins every package that gets installed and
# adds none by itself. pyproject.toml keeps the compatible ranges, for installing this package
# into an environment of one's own. UNLOCKED=1 installs the newest releases those ranges allow
# instead (what scripts/refresh_lock.sh tries before it rewrites the lock).
# TORCH_SPEC picks the torch build (default: the locked torch, the CPU wheel on our machines);
# on a GPU machine set it to the CUDA build you use: torch and triton then leave the
# constraints, as a CUDA torch pins its own triton. Transformer Engine is the optional extra
# `te` and must only be installed where CUDA exists (scripts/install_te.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}
lock=requirements.lock
python3 -m venv "$venv"
pip() { "$venv/bin/python" -m pip --disable-pip-version-check "$@"; }
constraints="$venv/constraints.txt"
if [[ "${UNLOCKED:-0}" == 1 ]]; then
    : > "$constraints"
elif [[ -n "${TORCH_SPEC:-}" ]]; then
    grep -vE '^(torch|triton)==' "$lock" > "$constraints"
else
    cp "$lock" "$constraints"
fi
locked() { sed -n "s/^$1==//p" "$lock"; }
pip install -q -c "$constraints" "${TORCH_SPEC:-torch==$(locked torch)}"
# megatron-core 0.19.2's metadata asks for Python >= 3.12; its cp311 wheel works on 3.11.
pip install -q --no-deps --ignore-requires-python "megatron-core==$(locked megatron-core)"
pip install -q -c "$constraints" -e ".[dev,demo,sweep,eval]"
