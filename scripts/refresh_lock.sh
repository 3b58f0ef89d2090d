#!/usr/bin/env bash
# Move requirements.lock to the newest releases pyproject.toml allows, as a deliberate, tested
# step: install them into a scratch venv (UNLOCKED=1), run the whole suite there, and only if
# it passes write that venv's versions as the new lock and print what changed. Then commit the
# lock with the change that needed it, and run `make test-hf-versions`.
# Usage: scripts/refresh_lock.sh [SCRATCH_VENV]   (default .venv-refresh; rebuilt each time)
# torch stays at the locked release unless TORCH_SPEC names another (its build, CPU or CUDA,
# is the machine's choice); megatron-core is pinned in pyproject.toml. The transformers range
# is the remote code's (SUPPORTED_TRANSFORMERS), and a newer release beyond it is reported,
# not taken: widening it means testing it first.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-refresh}
rm -rf "$venv"
UNLOCKED=1 bash scripts/install.sh "$venv"
py="$venv/bin/python"
{
    echo "# pip constraints: the versions the whole test suite last passed with (Python 3.11,"
    echo "# Linux x86_64). Written by scripts/refresh_lock.sh; scripts/install.sh installs them."
    "$py" -m pip --disable-pip-version-check freeze --exclude-editable \
        | sed -E 's/\+[A-Za-z0-9.]+$//' | LC_ALL=C sort -f
} > "$venv/requirements.lock"
newest=$("$py" -m pip --disable-pip-version-check index versions transformers 2>/dev/null \
         | sed -n 's/^transformers (\(.*\))$/\1/p')
"$py" - "$newest" <<'PY'
import sys
from packaging.specifiers import SpecifierSet
from pretrain.hf.remote.configuration_siamesenorm import SUPPORTED_TRANSFORMERS as supported
newest = sys.argv[1]
if newest and not SpecifierSet(supported).contains(newest):
    print(f"refresh_lock: transformers {newest} is out, beyond the supported {supported}; to "
          "take it, widen SUPPORTED_TRANSFORMERS and pyproject's range, then run "
          "`make test-hf-versions` and this again", file=sys.stderr)
PY
if ! "$py" -m pytest -q; then
    echo "refresh_lock: the suite fails on the newest releases; requirements.lock unchanged" \
         "(the candidate is $venv/requirements.lock)" >&2
    exit 1
fi
echo "refresh_lock: the suite passed; changes (< locked before, > now):"
diff <(grep -v '^#' requirements.lock) <(grep -v '^#' "$venv/requirements.lock") \
    | grep '^[<>]' || echo "  none"
cp "$venv/requirements.lock" requirements.lock
echo "refresh_lock: requirements.lock now holds the versions above; commit it"
