"""Compile every Triton kernel launch the fused ops make, for a GPU this machine may not have.

Run as ``python -m tests.triton_aot ARCH`` (e.g. 90 for H100) in a process *without*
TRITON_INTERPRET: every launch ``bench.triton_launches`` records (its default cases) is
compiled by Triton's real compiler down to a cubin for ``sm_ARCH``. The interpreter
accepts code the compiler rejects (types that change across a loop, an int64 grid index mixed
with int32 strides...), so this is the CPU machine's check that the kernels build for a GPU.
Prints one JSON line: the launches compiled, each with its kernel, constexprs and cubin size.
"""

from __future__ import annotations

import json
import os
import sys

if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("tests.triton_aot must run without TRITON_INTERPRET=1")

from bench.triton_launches import arg_type, compile_launch, record_launches  # noqa: E402


def main(arch: int) -> None:
    seen, report = set(), []
    for name, args, kwargs, _case in record_launches():
        types = tuple(arg_type(a) for a in args)
        key = (name, types, tuple(sorted(kwargs.items())))
        if key in seen:
            continue
        seen.add(key)
        constexprs = {k: v for k, v in kwargs.items() if k != "num_warps"}
        compiled = compile_launch(name, args, dict(kwargs), arch)
        report.append({"kernel": name, "dtypes": sorted({t for t in types if t[0] == "*"}),
                       "constexprs": constexprs, "cubin_bytes": len(compiled.asm["cubin"])})
    print(json.dumps(report))


if __name__ == "__main__":
    main(int(sys.argv[1]))
