#!/usr/bin/env bash
# Install Transformer Engine into an existing environment on a GPU node, built against the
# CUDA torch already there. Usage: scripts/install_te.sh [VENV_DIR]   (default .venv)
#
# TE ships as three packages: transformer-engine (Python), transformer-engine-cu<N> (the CUDA
# libraries, matching torch's CUDA major version) and transformer-engine-torch (an sdist that
# compiles against torch; with pip's build isolation it would fetch a second torch, ~3 GB,
# and build against that one instead). TE_VERSION picks the release (default 2.20.2).
# Never on a CPU machine: with TE installed and no CUDA, `import megatron.core` fails.
set -euo pipefail
venv=${1:-.venv}
py="$venv/bin/python"
pip() { "$py" -m pip --disable-pip-version-check "$@"; }
if ! "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "install_te: $venv's torch sees no CUDA device; Transformer Engine must only be" \
         "installed on GPU machines (elsewhere it breaks 'import megatron.core')" >&2
    exit 2
fi
cuda=$("$py" -c "import torch; print(torch.version.cuda.split('.')[0])")
version=${TE_VERSION:-2.20.2}
pip install -q pybind11 ninja "transformer-engine==$version" "transformer-engine-cu$cuda==$version"
pip install -q --no-build-isolation --no-deps "transformer-engine-torch==$version"
"$py" - <<'PY'
import megatron.core  # noqa: F401  (fails here if TE does not match this torch)
import transformer_engine.pytorch as te
from model.backends import te_unavailable_reason

reason = te_unavailable_reason()
print(f"Transformer Engine {te.__version__}: " + ("usable" if reason is None else reason))
PY
