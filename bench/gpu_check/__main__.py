"""python -m bench.gpu_check [--out DIR] [--budget 480] [--rehearse] [--parts a,b]

On a GPU: the check in priority order within ``--budget`` seconds (bench/gpu_check). With
``--rehearse`` (on a CPU): the same parts at tiny shapes, Triton's kernels in its interpreter.
Writes ``DIR/gpu-check.{json,md}`` and one JSON per part; exit 1 if a part or a test failed.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the Triton kernels run in the interpreter; Triton reads
    os.environ.setdefault("TRITON_INTERPRET", "1")  # this when a kernel module is imported

from bench.gpu_check import bench_parts, setup_parts  # noqa: E402
from bench.gpu_check.plan import GPU, REHEARSAL, Context, Part, run_parts  # noqa: E402
from runtime import cpu_compat  # noqa: E402

# Priority order; each budget is the most the part may take, ``needs`` the least time left
# for it to start. The first five fill 480 s when each uses its whole budget.
PARTS = [
    Part("environment", "device, driver, versions, commit", 20, 1, setup_parts.environment),
    Part("calibration", "device copy GB/s, GEMM TFLOP/s", 20, 5, setup_parts.calibration),
    Part("tests", "gpu-marked kernel, model and CLI tests", 200, 60, setup_parts.tests),
    Part("norms", "fused norms' bandwidth, fwd and fwd+bwd", 70, 20, bench_parts.norms),
    Part("steps", "step table: pre, siamese, siamese_hybrid", 170, 40, bench_parts.steps),
    Part("moe", "pre and siamese with experts in every block", 90, 40, bench_parts.moe),
    Part("more_schemes", "post and hybridnorm steps", 60, 30, bench_parts.more_schemes),
    Part("optimizer", "optimizer step at the full depth: AdamW, then Muon", 80, 30,
         bench_parts.optimizer),
    Part("profile", "kernels of siamese against pre", 45, 30, bench_parts.profile),
    Part("kernel_alternatives", "backward layouts at 4096 and 8192", 40, 15,
         bench_parts.kernel_alternatives),
    Part("documents", "steps with document attention (flex)", 45, 30, bench_parts.documents),
    Part("compiled", "pre and siamese compiled, then with CUDA graphs", 120, 60,
         bench_parts.compiled_steps),
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "runs/gpu-check"),
                   help="output folder (default: $OUT, else runs/gpu-check)")
    p.add_argument("--budget", type=float, default=480.0, help="seconds for the whole check")
    p.add_argument("--rehearse", action="store_true",
                   help="tiny shapes on the CPU (what a GPU run does, minus the figures)")
    p.add_argument("--bundle", type=Path, default=Path("gpu-bundle"),
                   help="the carried bundle (its manifest names the commit of a copied tree)")
    p.add_argument("--parts", default=",".join(part.name for part in PARTS),
                   help="comma-separated parts to run, in the order above")
    args = p.parse_args(argv)
    known = {part.name for part in PARTS}
    for name in args.parts.split(","):
        if name not in known:
            p.error(f"--parts: {name!r} is not one of {', '.join(sorted(known))}")
    if args.budget <= 0:
        p.error(f"--budget must be > 0 seconds, got {args.budget:g}")
    if not args.rehearse and not torch.cuda.is_available():
        p.error("no CUDA GPU here: run with --rehearse for the CPU rehearsal")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    chosen = set(args.parts.split(","))
    context = Context(out=args.out, sizes=REHEARSAL if args.rehearse else GPU,
                      rehearsal=args.rehearse, bundle=args.bundle)
    with cpu_compat.enabled():  # inert with CUDA
        result = run_parts([part for part in PARTS if part.name in chosen], context,
                           args.budget)
    failed = [name for name, p in result["parts"].items() if p["status"] == "failed"]
    failed += [t["id"] for t in result.get("tests", {}).get("tests", [])
               if t["outcome"] in ("failed", "error")]
    print(f"bench.gpu_check: {args.out / 'gpu-check.md'} ({result['seconds']:.0f} s)"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
