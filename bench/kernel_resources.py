"""What every Triton kernel launch of the model compiles to on the GPUs we target, measured on a
CPU machine: registers per thread, local memory (spills), shared memory, programs resident per
SM and the waves a 16k-row launch takes.

    python -m bench.kernel_resources [--arch 90] [--hidden 256,1024,2048,4096,8192]
        [--dtype bf16,fp32] [--norm rmsnorm,layernorm+bias,layernorm] [--rows 16384]
        [--sms 132] [--json]

Each launch ``bench.triton_launches`` records for those widths, dtypes and norms is compiled by
Triton for ``sm_ARCH`` (90: H100, 80: A100, 100: B200), and its registers and local memory
(the bytes a thread spills to) are read from the cubin Triton built (``bench.cubin``): the
binary a GPU loads, assembled by Triton's own ptxas with Triton's own flags, which change
the answer (a compiled kernel reads these numbers from the driver, which this machine need
not have). Occupancy follows from them by the rules ``kernels.occupancy`` holds, the ones the
ops size their backward grids with on a GPU: registers per warp rounded up to 256 of a 64K
register file, at most 64 warps and 32 programs per SM, shared memory per program plus 1 KiB
reserved. The grid is what the ops launch over ``--rows`` rows on ``--sms`` SMs: a forward
launch has one program per ROWS rows; a backward launch (a kernel looping over rows into
weight-gradient partials) one wave of its own programs per SM, at least 16 rows each
(``kernels.occupancy.backward_programs``), so its waves are at most 1; where the kernel fits
one program per SM it is compiled again with its registers capped for two (``reg cap``), and
that compile is the one reported if it uses no local memory (``kernels.occupancy.fit``, as
the ops choose on a GPU). Waves above 1 mean programs wait for others to finish; a last wave
that is a small fraction leaves most SMs idle.

Compiling takes a few seconds per launch the first time (Triton caches the result). Runs
without a GPU and without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

from bench.common import int_list, versions_line
from bench.cubin import cubin_resources
from bench.triton_launches import NORMS, Case, arg_type, compile_launch, record_launches
from kernels import triton_kernels
from kernels.occupancy import (
    SHARED_KIB,
    Resources,
    arch_limits,
    backward_programs,
    fit,
    programs_per_sm,
)
from runtime.markdown import markdown_table

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
NORM_NAMES = {Case(torch.float32, rms, bias, 0).norm: (rms, bias) for rms, bias in NORMS}
PARTIALS_ARG = "dw_ptr"  # the weight-gradient partials of a kernel that loops over rows


_MEASURED: dict[tuple, Resources] = {}


def launch_resources(name: str, args: tuple, kwargs: dict, arch: int) -> Resources:
    """:class:`Resources` of a recorded launch (``bench.triton_launches``: kernel name,
    positional args, constexprs, num_warps and a register cap) as Triton compiles it for
    ``sm_ARCH``: registers and local memory from its cubin, shared memory from its metadata.
    Compiled once per kernel, argument types, constexprs and architecture (the launches of
    one width share their alignment hints)."""
    key = (name, tuple(arg_type(a) for a in args), tuple(sorted(kwargs.items())), arch)
    if key not in _MEASURED:
        compiled = compile_launch(name, args, dict(kwargs), arch)
        found = cubin_resources(compiled.asm["cubin"], compiled.metadata.name)
        _MEASURED[key] = Resources(found.registers, found.local, compiled.metadata.shared)
    return _MEASURED[key]


def fitted_resources(name: str, args: tuple, kwargs: dict,
                     arch: int) -> tuple[Resources, int | None]:
    """:func:`launch_resources` of a recorded launch as the ops compile it, and its register
    cap: a backward kernel (one that loops over rows into partials) is capped to fit two
    programs per SM where that compiles without a spill (``kernels.occupancy.fit``, the rule
    the ops apply on a GPU); None: the compiler's choice."""
    found = launch_resources(name, args, kwargs, arch)
    if PARTIALS_ARG not in getattr(triton_kernels, name).arg_names:
        return found, None
    chosen = fit(found, lambda cap: launch_resources(name, args, {**kwargs, "maxnreg": cap},
                                                     arch),
                 kwargs["num_warps"], arch_limits(arch))
    if chosen.maxnreg is None:
        return found, None
    return launch_resources(name, args, {**kwargs, "maxnreg": chosen.maxnreg},
                            arch), chosen.maxnreg


def grid(kernel: str, constexprs: dict, rows: int, sms: int, resident: int) -> int:
    """Programs a launch over ``rows`` rows starts, by the ops' own grid rules: a kernel that
    loops over rows into weight-gradient partials one wave of its ``resident`` programs per
    SM (at least 16 rows each), any other one program per ROWS rows."""
    if PARTIALS_ARG in getattr(triton_kernels, kernel).arg_names:
        return backward_programs(rows, sms, resident)
    return math.ceil(rows / constexprs["ROWS"])


def measure(cases: list[Case], arches: list[int], rows: int, sms: int) -> list[dict]:
    """One row per distinct launch (kernel, argument types, constexprs) and architecture."""
    seen, out = set(), []
    for name, args, kwargs, case in record_launches(cases):
        key = (name, tuple(arg_type(a) for a in args), tuple(sorted(kwargs.items())))
        if key in seen:
            continue
        seen.add(key)
        constexprs = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
        num_warps = kwargs["num_warps"]
        for arch in arches:
            found, maxnreg = fitted_resources(name, args, kwargs, arch)
            resident = programs_per_sm(found, num_warps, arch)
            programs = grid(name, constexprs, rows, sms, resident)
            out.append({
                "arch": arch, "kernel": name, "variant": _variant(name, constexprs),
                "norm": case.norm, "dtype": "bf16" if case.dtype == torch.bfloat16 else "fp32",
                "hidden": case.hidden, "tile": _tile(constexprs), "num_warps": num_warps,
                "maxnreg": maxnreg, "constexprs": constexprs,
                **found._asdict(),
                "programs_per_sm": resident, "grid": programs,
                "waves": programs / (resident * sms),
            })
    return out


def _variant(kernel: str, constexprs: dict) -> str:
    """What a launch of a shared kernel computes: its flags that are on (the norm's own,
    IS_RMS and HAS_BIAS, are in the norm column)."""
    flags = [k.lower() for k, v in constexprs.items()
             if v is True and k not in ("IS_RMS", "HAS_BIAS")]
    return "+".join(flags) or "-"


def _tile(constexprs: dict) -> str:
    """Rows x values per row of a program's tile (the Q/K/V norm's rows hold heads x dim)."""
    width = constexprs.get("BLOCK") or f"{constexprs['HEADS']}x{constexprs['DIM']}"
    return f"{constexprs['ROWS']}x{width}"


def table(rows: list[dict]) -> str:
    header = ["sm", "kernel", "variant", "norm", "dtype", "hidden", "tile", "warps",
              "reg cap", "regs", "local B", "shared KiB", "programs/SM", "grid", "waves"]
    body = [[str(r["arch"]), r["kernel"], r["variant"], r["norm"], r["dtype"], str(r["hidden"]),
             r["tile"], str(r["num_warps"]), str(r["maxnreg"] or "-"), str(r["registers"]),
             f"{r['local']:,}", f"{r['shared'] / 1024:.1f}",
             str(r["programs_per_sm"]), f"{r['grid']:,}", f"{r['waves']:.2f}"] for r in rows]
    return markdown_table(header, body, right_from=5)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int_list, default=[90], help="e.g. 80,90,100")
    p.add_argument("--hidden", type=int_list, default=[256, 1024, 2048, 4096, 8192])
    p.add_argument("--dtype", default="bf16,fp32")
    p.add_argument("--norm", default=",".join(NORM_NAMES))
    p.add_argument("--rows", type=int, default=16384, help="rows of one launch (tokens)")
    p.add_argument("--sms", type=int, default=132, help="SMs of the GPU (H100 SXM: 132)")
    p.add_argument("--json", action="store_true", help="one JSON line instead of the table")
    args = p.parse_args(argv)
    for arch in args.arch:
        if arch not in SHARED_KIB:
            p.error(f"--arch {arch}: one of {', '.join(map(str, SHARED_KIB))}")
    for name, known in (("dtype", DTYPES), ("norm", NORM_NAMES)):
        for value in getattr(args, name).split(","):
            if value not in known:
                p.error(f"--{name} {value}: one of {', '.join(known)}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("bench.kernel_resources compiles kernels: run it without "
                         "TRITON_INTERPRET=1")
    cases = [Case(DTYPES[d], *NORM_NAMES[n], h) for h in args.hidden
             for d in args.dtype.split(",") for n in args.norm.split(",")]
    rows = measure(cases, args.arch, args.rows, args.sms)
    if args.json:
        print(json.dumps(rows))
        return
    spilling = [r for r in rows if r["local"]]
    print(f"{len(rows)} launches compiled ({versions_line()}); {args.rows:,} rows on "
          f"{args.sms} SMs; {len(spilling)} spill")
    print(table(rows))


if __name__ == "__main__":
    sys.exit(main())
