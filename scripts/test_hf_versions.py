"""The Hugging Face export tests against both ends of the supported transformers range.

An exported folder must work wherever a user loads it: an environment with torch and some
transformers release, nothing of this project. So for the oldest and the newest release that
``SUPPORTED_TRANSFORMERS`` admits (looked up on the package index), this builds a venv of its
own holding only the locked torch and that release (``.venv-hf/<version>``, kept for the next
run), and runs ``tests/pretrain/hf/test_hf_remote.py`` and
``tests/pretrain/hf/test_hf_export.py`` in the project's venv with their transformers side
(``tests/hf_side.py``) running in that venv: every scheme's logits, cached and uncached greedy
decoding step by step, left-padded batches, bf16 gates.

Usage: ``python scripts/test_hf_versions.py [--versions 4.57.0,5.24.0]`` (``make
test-hf-versions``). Prints one row per release and exits non-zero if any failed.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pretrain.hf.remote.configuration_siamesenorm import SUPPORTED_TRANSFORMERS  # noqa: E402

TESTS = ["tests/pretrain/hf/test_hf_remote.py", "tests/pretrain/hf/test_hf_export.py"]
VENVS = ROOT / ".venv-hf"


def pip(python: Path | str, *args: str, capture: bool = False) -> str:
    done = subprocess.run([str(python), "-m", "pip", "--disable-pip-version-check", *args],
                          check=True, text=True, capture_output=capture)
    return done.stdout if capture else ""


def released(package: str) -> list[Version]:
    """Every release of ``package`` on the index (pre-releases left out)."""
    listing = pip(sys.executable, "index", "versions", package, capture=True)
    match = re.search(r"Available versions: (.*)", listing)
    if match is None:
        sys.exit(f"test_hf_versions: no releases of {package} found on the package index")
    versions = [Version(v) for v in match.group(1).split(", ")]
    return sorted(v for v in versions if not v.is_prerelease)


def range_ends(supported: str, releases: list[Version]) -> list[str]:
    """The oldest and the newest release inside the range."""
    inside = [v for v in releases if SpecifierSet(supported).contains(v)]
    if not inside:
        sys.exit(f"test_hf_versions: no transformers release satisfies {supported}")
    return sorted({str(inside[0]), str(inside[-1])}, key=Version)


def locked(package: str) -> str:
    lock = (ROOT / "requirements.lock").read_text()
    return re.search(rf"^{package}==(\S+)$", lock, re.MULTILINE).group(1)


def side_venv(version: str) -> Path:
    """``.venv-hf/<version>`` with the locked torch and that transformers, made once."""
    venv = VENVS / version
    python = venv / "bin" / "python"
    if not (venv / ".installed").exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        pip(python, "install", "-q", f"torch=={locked('torch')}", f"transformers=={version}")
        (venv / ".installed").touch()
    return python


def installed(python: Path, packages: tuple[str, ...]) -> str:
    freeze = pip(python, "freeze", capture=True).lower().replace("_", "-")
    found = dict(line.split("==", 1) for line in freeze.split() if "==" in line)
    return ", ".join(f"{p} {found.get(p, '-')}" for p in packages)


def run_tests(python: Path) -> tuple[bool, str, float]:
    """The export tests with their transformers side in ``python``'s venv."""
    env = {**os.environ, "HF_SIDE_PYTHON": str(python)}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", *TESTS], cwd=ROOT, env=env,
                          text=True, capture_output=True)
    seconds = time.perf_counter() - start
    lines = done.stdout.strip().splitlines()
    summary = lines[-1].strip("= ") if lines else done.stderr.strip()[-200:]
    if done.returncode != 0:
        print(done.stdout[-6000:], file=sys.stderr)
    return done.returncode == 0, summary, seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", help="comma-separated releases instead of the range's "
                        "two ends")
    args = parser.parse_args(argv)
    versions = (args.versions.split(",") if args.versions
                else range_ends(SUPPORTED_TRANSFORMERS, released("transformers")))
    print(f"supported transformers {SUPPORTED_TRANSFORMERS}; testing {', '.join(versions)} "
          f"(torch {locked('torch')}); tests: {' '.join(TESTS)}")
    rows, failed = [], False
    for version in versions:
        python = side_venv(version)
        ok, summary, seconds = run_tests(python)
        failed |= not ok
        deps = installed(python, ("tokenizers", "huggingface-hub", "safetensors"))
        rows.append(f"| {version} | {deps} | {summary} | {seconds:.0f} s |")
        print(rows[-1], flush=True)
    print("\n| transformers | its venv also has | tests | time |\n|---|---|---|---|")
    print("\n".join(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
