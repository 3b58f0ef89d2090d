"""The version-sensitive tests against torch/triton releases other than the lock's, on the CPU.

Why: ``requirements.lock`` pins torch 2.13.0 and triton 3.9.0 (the CPU wheel), but the GPU
machine we are lent runs torch 2.11.0+cu130, triton 3.6.0 and Python 3.12, and newer torch
releases are published. GPU sessions are rare and short, so a break that only another torch or
triton brings (a Triton interpreter or language change, a torch.library/opcheck rule, a dynamo
graph break or recompile, a changed numerical default) should show up on the CPU first, not in
the middle of a GPU loan.

What: for each environment this builds (once, then reuses) a venv next to the lock,
``.venv-versions/<name>``, with ``scripts/install.sh`` and ``TORCH_SPEC`` naming the torch:
torch and triton leave the lock's constraints (a CUDA torch wheel from PyPI pins its own
triton), every other package stays at its locked version, megatron-core goes in with
``--no-deps --ignore-requires-python`` as always. PyPI's Linux torch wheels are CUDA builds;
they import and run on a CPU machine, so the tests below run as in the lock's venv (Triton's
interpreter, no GPU). Environments:

- ``gpu-image``: torch 2.11.0 (its wheel pins triton 3.6.0), the GPU machine's versions.
- ``newest``: the newest torch on the package index (looked up with the machine's pip
  configuration switched off, ``PIP_CONFIG_FILE=/dev/null``, since ``/etc/xdg/pip`` caps torch
  here) and the triton its wheel pins; the newest triton on the index is printed beside it.
- ``lock``: the project's own ``.venv`` (not built here), the baseline row.

In each it runs, in one pytest process under ``nice -n 19``, the tests that touch what differs
between versions (:data:`TESTS`, about 5-8 minutes per environment on a 2-core CPU): the
Triton kernels through the interpreter, the kernel bounds check, the registered ops under
``torch.library.opcheck``, compiled blocks (the fast tier of ``test_compiled_blocks.py``: no
graph break or recompile, compiled equals eager), the scheme equations, the GPU check's CPU
rehearsal, and CLI smoke runs (a tiny training run, eval of its checkpoint, a compiled CLI run).

Not checked here: Python 3.12 (only 3.11 is installable on our CPU machines, so the GPU
image's Python difference stays unchecked), and anything that needs a GPU (the ``gpu``-marked
tests skip; the kernels run in Triton's interpreter, not compiled for a device).

Usage: ``python scripts/test_versions.py [--envs gpu-image,newest] [--rebuild]``
(``make test-versions``; ``--envs lock,gpu-image,newest`` adds the baseline row). Prints one row
per environment (torch, triton, python, passed/failed/skipped, seconds) and exits non-zero if
any test failed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENVS = ROOT / ".venv-versions"

# The version-sensitive tests; "-m not slow" keeps a module to its fast tier.
TESTS = [
    # Triton kernels through the interpreter, the bounds check, opcheck of registered ops.
    "tests/kernels/test_triton_kernels.py",
    "tests/kernels/test_kernels.py",
    "tests/kernels/test_partials.py",
    "tests/kernels/test_kernel_bounds.py",
    "tests/kernels/test_registered_ops.py",
    "tests/kernels/test_occupancy.py",
    # torch.compile: no graph break nor recompile, compiled matches eager (fast tier only).
    "tests/model/test_compiled_blocks.py -m 'not slow'",
    # the schemes' equations and the model's parity with the reference code.
    "tests/model/test_equations.py",
    "tests/model/test_streams.py",
    # the GPU check rehearsed on the CPU at tiny shapes.
    "tests/bench/test_gpu_check.py::test_the_check_rehearsed_on_the_cpu_runs_every_part",
    # CLI smoke runs: train, eval its checkpoint, a compiled run against eager.
    "tests/pretrain/test_pretrain.py::test_training_lowers_validation_loss_and_fills_run_folder",
    "tests/pretrain/test_pretrain.py::test_eval_command_reports_checkpoint_perplexity",
    "tests/model/test_compiled_blocks.py::test_cli_run_compiled_matches_eager",
]

NO_PIP_CONFIG = {"PIP_CONFIG_FILE": "/dev/null"}


def pip_index_newest(package: str) -> str:
    """The newest release of ``package`` on PyPI, past this machine's pip caps."""
    done = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "index",
                           "versions", package], check=True, text=True, capture_output=True,
                          env={**os.environ, **NO_PIP_CONFIG})
    match = re.search(r"^\S+ \((\S+)\)", done.stdout, re.MULTILINE)
    if match is None:
        sys.exit(f"test_versions: no releases of {package} found on the package index")
    return match.group(1)


def recipe(spec: str) -> str:
    """What a venv was built from: its torch spec and the install files' contents."""
    digest = hashlib.sha256(spec.encode())
    for name in ("scripts/install.sh", "requirements.lock", "pyproject.toml"):
        digest.update((ROOT / name).read_bytes())
    return digest.hexdigest()


def build(name: str, spec: str, extra_env: dict[str, str], rebuild: bool) -> Path:
    """``.venv-versions/<name>`` from ``scripts/install.sh`` with ``TORCH_SPEC=spec``."""
    venv = VENVS / name
    stamp = venv / ".installed"
    if not rebuild and stamp.exists() and stamp.read_text() == recipe(spec):
        return venv / "bin" / "python"
    print(f"[{name}] installing {spec} into {venv.relative_to(ROOT)} (a CUDA wheel: minutes)",
          flush=True)
    subprocess.run(["bash", "scripts/install.sh", str(venv)], cwd=ROOT, check=True,
                   env={**os.environ, "TORCH_SPEC": spec, **extra_env})
    stamp.write_text(recipe(spec))
    return venv / "bin" / "python"


def versions(python: Path) -> tuple[str, str, str]:
    code = ("import platform, torch, importlib.metadata as m\n"
            "try: t = m.version('triton')\nexcept m.PackageNotFoundError: t = '-'\n"
            "print(torch.__version__, t, platform.python_version())")
    out = subprocess.run([str(python), "-c", code], check=True, text=True, capture_output=True)
    return tuple(out.stdout.split())


def run_tests(python: Path, tests: list[str], log: Path) -> tuple[dict[str, int], float, bool]:
    """The tests in one pytest process under nice (its output in ``log``); counts from its
    JUnit report."""
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    start = time.perf_counter()
    ok = True
    log.write_text("")
    with tempfile.TemporaryDirectory() as tmp:
        # The plain paths and node ids in one pytest run; an entry with options in one more.
        plain = [t for t in tests if " " not in t]
        groups = [plain] + [shlex.split(t) for t in tests if " " in t]
        for i, group in enumerate(groups):
            xml = Path(tmp) / f"{i}.xml"
            with log.open("a") as out:
                done = subprocess.run(["nice", "-n", "19", str(python), "-m", "pytest", "-q",
                                       "-p", "no:cacheprovider", "--durations=10",
                                       f"--junitxml={xml}", *group],
                                      cwd=ROOT, text=True, stdout=out, stderr=subprocess.STDOUT)
            lines = log.read_text().strip().splitlines()
            print(f"    {' '.join(group)}: {lines[-1].strip('= ') if lines else '?'}",
                  flush=True)
            ok &= done.returncode == 0
            if not xml.exists():
                counts["failed"] += 1
                continue
            for suite in ET.parse(xml).getroot().iter("testsuite"):
                tests_n, skipped = int(suite.get("tests")), int(suite.get("skipped"))
                bad = int(suite.get("failures")) + int(suite.get("errors"))
                counts["passed"] += tests_n - skipped - bad
                counts["failed"] += bad
                counts["skipped"] += skipped
    if not ok:
        print(f"    failures: see {log.relative_to(ROOT)}", flush=True)
    return counts, time.perf_counter() - start, ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", default="gpu-image,newest",
                        help="comma-separated, from lock, gpu-image, newest (default: "
                        "gpu-image,newest)")
    parser.add_argument("--torch", help="torch release for 'newest' instead of the index's")
    parser.add_argument("--rebuild", action="store_true", help="rebuild the venvs")
    parser.add_argument("--tests", help="comma-separated test entries instead of TESTS")
    args = parser.parse_args(argv)
    tests = args.tests.split(",") if args.tests else TESTS
    rows, failed = [], False
    for name in args.envs.split(","):
        if name == "lock":
            python = ROOT / ".venv" / "bin" / "python"
        elif name == "gpu-image":
            python = build(name, "torch==2.11.0", {}, args.rebuild)
        elif name == "newest":
            newest = args.torch or pip_index_newest("torch")
            print(f"[newest] torch {newest} (newest triton on the index: "
                  f"{pip_index_newest('triton')})", flush=True)
            python = build(name, f"torch=={newest}", NO_PIP_CONFIG, args.rebuild)
        else:
            sys.exit(f"test_versions: unknown environment {name!r} (lock, gpu-image, newest)")
        torch_v, triton_v, python_v = versions(python)
        print(f"[{name}] torch {torch_v}, triton {triton_v}, python {python_v}", flush=True)
        counts, seconds, ok = run_tests(python, tests, VENVS / f"{name}.tests.log")
        failed |= not ok
        rows.append(f"| {name} | {torch_v} | {triton_v} | {python_v} | {counts['passed']} / "
                    f"{counts['failed']} / {counts['skipped']} | {seconds:.0f} |")
        print(rows[-1], flush=True)
    print("\n| environment | torch | triton | python | passed / failed / skipped | seconds |\n"
          "|---|---|---|---|---|---:|")
    print("\n".join(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
