"""The fused kernels build for an H100 with Triton's real compiler, without a GPU.

The parity tests run the kernels in Triton's interpreter, which accepts code the compiler
rejects; this compiles every launch the ops make (``tests/triton_aot.py``) to an sm_90 cubin.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.pretrain_fixtures import REPO

pytestmark = pytest.mark.slow

pytest.importorskip("triton")

KERNELS = {"norm_fwd", "norm_bwd", "entry_fwd", "entry_bwd", "dual_update_fwd",
           "dual_update_bwd", "qkv_norm_fwd", "qkv_norm_bwd"}


def test_every_kernel_launch_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-W", "ignore", "-m", "tests.triton_aot", "90"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert {r["kernel"] for r in report} == KERNELS
    assert all(r["cubin_bytes"] > 0 for r in report)
    entry = {tuple(sorted(r["constexprs"].items())) for r in report if r["kernel"] == "entry_fwd"}
    # (RMS, Layer with bias, Layer without) x (entry, entry without Nin, update+entry, the
    # same computing u from the layer input, gated entry, merge), each at one row per tile
    # (hidden 2048) and, RMS and Layer with bias, at several (256)
    assert len(entry) == 18 + 12
    assert {r["constexprs"]["ROWS"] for r in report if r["kernel"] == "entry_fwd"} == {1, 8}
    assert {r["constexprs"]["ROWS"] for r in report if r["kernel"] == "norm_bwd"} == {2, 16}
    assert {tuple(r["dtypes"]) for r in report} >= {("*bf16", "*fp32"), ("*fp32",)}
    # the plain norm, and Post-Norm's residual add fused into it, forward and backward
    assert {(r["kernel"], r["constexprs"]["HAS_RESIDUAL"]) for r in report
            if r["kernel"].startswith("norm_")} == {(k, v) for k in ("norm_fwd", "norm_bwd")
                                                    for v in (True, False)}
