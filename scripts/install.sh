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
#
# It says what it is doing as it goes: a numbered line per stage with the time since the start,
# pip's own lines under it (what it collects and downloads, a progress bar on a terminal;
# PIP_QUIET=1 keeps only the stage lines), and at the end which versions it installed.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}
lock=requirements.lock
stage=0
say() {  # "[install 2/5, 0m41s] what": a stage begins
    stage=$((stage + 1))
    printf '[install %d/5, %dm%02ds] %s\n' "$stage" $((SECONDS / 60)) $((SECONDS % 60)) "$*"
}
say "creating the virtual environment $venv ($(python3 --version))"
python3 -m venv "$venv"
pip() { "$venv/bin/python" -m pip --disable-pip-version-check "$@"; }
constraints="$venv/constraints.txt"
if [[ "${UNLOCKED:-0}" == 1 ]]; then
    : > "$constraints"
    pins="no pins (UNLOCKED=1: the newest releases pyproject.toml allows)"
elif [[ -n "${TORCH_SPEC:-}" ]]; then
    grep -vE '^(torch|triton)==' "$lock" > "$constraints"
    pins="the $(grep -c '==' "$constraints") versions of $lock but torch's and triton's"
else
    cp "$lock" "$constraints"
    pins="the $(grep -c '==' "$constraints") versions of $lock"
fi
locked() { sed -n "s/^$1==//p" "$lock"; }
torch=${TORCH_SPEC:-torch==$(locked torch)}
say "installing $torch, the largest download, with $pins"
pip install -c "$constraints" "$torch"
# megatron-core 0.19.2's metadata asks for Python >= 3.12; its cp311 wheel works on 3.11.
say "installing megatron-core==$(locked megatron-core) alone (the project lists what it needs)"
pip install --no-deps --ignore-requires-python "megatron-core==$(locked megatron-core)"
say "installing the project (editable, extras dev, demo, sweep, eval) and its dependencies"
pip install -c "$constraints" -e ".[dev,demo,sweep,eval]"
say "checking the environment: dependencies complete, the pins installed, the imports work"
pip check || echo "[install] warning: pip check found the conflicts above"
"$venv/bin/python" -W ignore - "$constraints" <<'PY'
import importlib
import sys
from importlib.metadata import distributions, version


def name(text: str) -> str:
    return text.lower().replace("_", "-").replace(".", "-")


# The versions the environment resolves: the first of each name on sys.path, read before any
# import (setuptools, imported by torch, appends its own vendored copies of a few packages).
installed: dict[str, str] = {}
for dist in distributions():
    installed.setdefault(name(dist.metadata["Name"] or ""), dist.version)
pins = dict(line.strip().split("==", 1) for line in open(sys.argv[1])
            if "==" in line and not line.startswith("#"))
wrong = [f"{pkg} {installed[name(pkg)]} (pinned {pinned})" for pkg, pinned in pins.items()
         if name(pkg) in installed and installed[name(pkg)].split("+")[0] != pinned]
if wrong:  # constraints make this impossible; if it happens, the install is not the lock's
    sys.exit("[install] error: not the pinned versions: " + ", ".join(wrong))
for module in ("torch", "megatron.core", "pretrain"):  # megatron: installed past its Python
    importlib.import_module(module)                     # requirement, so checked by import
absent = sorted(pkg for pkg in pins if name(pkg) not in installed)
print(f"[install] done: {len(installed)} packages, {len(pins) - len(absent)} at the versions "
      f"pinned" + (f" (pinned, not needed here: {', '.join(absent)})" if absent else "")
      + f"; torch {version('torch')}, megatron-core {version('megatron-core')}, python "
      f"{sys.version.split()[0]}")
PY
