"""The check's first parts: the environment, a calibration of the device, and the gpu-marked
correctness tests (run by pytest in a child process, each test's outcome written the moment
it is known, so a run stopped at its budget still says which tests passed)."""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import torch

from bench.common import package_version, time_ms
from bench.gpu_check.plan import Context

REPO = Path(__file__).resolve().parents[2]
# The gpu-marked tests that check the kernels and the whole model, cheapest first: full-size
# kernel parity for every fused op, bf16 whole-model and attention parity with their negative
# controls, then the CLI on the GPU (train, SIGTERM, resume, eval). Left out: the benchmarks'
# smoke tests (this check runs the benchmarks themselves) and the NCCL tests (two GPUs).
TEST_FILES = ("tests/kernels/test_triton_kernels.py", "tests/model/test_sdpa_attention.py",
              "tests/pretrain/test_gpu_e2e.py")
PACKAGES = ("triton", "megatron-core", "numpy", "transformers", "sentencepiece",
            "wandb", "transformer-engine")


def environment(ctx: Context) -> dict:
    """Device, driver, CUDA, package versions and the commit measured."""
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "packages": {name: package_version(name) for name in PACKAGES},
            **commit(ctx.bundle), "bundle": bundle_state(ctx.bundle)}
    if not torch.cuda.is_available():
        return {**info, "device": "cpu (rehearsal)", "cpus": os.cpu_count()}
    props = torch.cuda.get_device_properties(0)
    return {**info, "device": props.name, "capability": f"{props.major}.{props.minor}",
            "sms": props.multi_processor_count, "memory_gib": round(props.total_memory / 2**30, 1),
            "driver": _query(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
            "nvcc": _query(["nvcc", "--version"]).splitlines()[-1:]}


def commit(bundle: Path) -> dict:
    """The commit of the tree measured: git's where the tree is a checkout, else the one the
    bundle recorded when it was built (a copied tree carries no .git)."""
    head = _query(["git", "rev-parse", "HEAD"])
    if head:
        dirty = _query(["git", "status", "--porcelain", "--untracked-files=no"])
        return {"commit": head, "tree_changed": bool(dirty), "commit_from": "git"}
    manifest = bundle / "manifest.json"
    if manifest.is_file():
        built = json.loads(manifest.read_text())
        return {"commit": built.get("commit"), "tree_changed": built.get("tree_changed"),
                "commit_from": "the bundle's manifest"}
    return {"commit": None, "commit_from": "unknown: no git and no bundle manifest"}


def bundle_state(folder: Path) -> dict:
    """The carried bundle's wheels and what is wrong with it (the tree's size is counted
    where git can list it, when the bundle is built)."""
    from bench.gpu_check.bundle import check

    if not folder.is_dir():
        return {"folder": str(folder), "present": False}
    return {"folder": str(folder), "present": True,
            "wheels": sorted(w.name for w in folder.glob("*.whl")),
            "problems": check(folder, tree=0)}


def _query(command: list[str]) -> str:
    """A command's output, '' if it is missing or fails."""
    try:
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def calibration(ctx: Context) -> dict:
    """The device's copy bandwidth (bytes read + written) and dense matrix-product rate: the
    ceilings the kernels' and steps' figures are read against."""
    from bench.fused_norms import copy_bandwidth

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if ctx.sizes.dtype == "bf16" else torch.float32
    n = ctx.sizes.gemm
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    gemm_ms = time_ms(lambda: a @ b, 3)
    return {"copy_gbs": copy_bandwidth(3, ctx.sizes.copy_bytes, device),
            "copy_bytes": ctx.sizes.copy_bytes, "gemm_tflops": 2 * n**3 / gemm_ms / 1e9,
            "gemm": f"{n} x {n} x {n} {ctx.sizes.dtype}"}


def tests(ctx: Context) -> dict:
    """The gpu-marked tests of ``TEST_FILES``, stopped at the part's deadline; every collected
    test's outcome (``not run`` for those the deadline left out)."""
    outcomes = ctx.out / "tests.jsonl"
    outcomes.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-rs",
               "-p", "bench.gpu_check.outcomes", f"--outcomes={outcomes}", *TEST_FILES]
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    stopped = False
    try:
        output, _ = proc.communicate(timeout=max(ctx.left(), 1))
    except subprocess.TimeoutExpired:  # the whole group: pytest and the CLI runs it started
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        stopped = True
    records = [json.loads(line) for line in outcomes.read_text().splitlines()] \
        if outcomes.is_file() else []
    collected = next((r["collected"] for r in records if "collected" in r), [])
    found = {r["id"]: r for r in records if "id" in r}
    rows = [found.get(test, {"id": test, "outcome": "not run",
                             "message": "the part's time ran out first" if stopped else ""})
            for test in collected]
    return {"command": " ".join(command[1:]), "exit": None if stopped else proc.returncode,
            "stopped_at_budget": stopped, "counts": dict(Counter(r["outcome"] for r in rows)),
            "tests": rows, "output_tail": output.splitlines()[-15:]}
