"""``bench.kernel_resources``' rows for a sample of launches, next to what NVIDIA's own tools
read from the cubin Triton builds for each launch.

Run as ``python -m tests.kernel_binaries HIDDEN DTYPE NORMS`` (e.g. ``4096 bf16
rmsnorm,layernorm+bias``) in a process *without* TRITON_INTERPRET. For each launch the tool
reports (its register cap included), the launch is compiled by Triton for sm_90 once more
(Triton's cache gives the same cubin) and its cubin read by ``cuobjdump
--dump-resource-usage`` (registers, stack frame) and ``nvdisasm`` (local stores and loads in
the SASS), each None where the tool is absent. Prints one JSON line: the tool's rows, each
with ``cuobjdump`` and ``sass`` added.
"""

from __future__ import annotations

import json
import os
import sys

if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("tests.kernel_binaries must run without TRITON_INTERPRET=1")

from bench.cubin import cuobjdump_resources, local_accesses, nvidia_tool  # noqa: E402
from bench.kernel_resources import DTYPES, NORM_NAMES, measure  # noqa: E402
from bench.triton_launches import Case, compile_launch, record_launches  # noqa: E402

ARCH = 90


def main(hidden: int, dtype: str, norms: str) -> None:
    cases = [Case(DTYPES[dtype], *NORM_NAMES[n], hidden) for n in norms.split(",")]
    rows = measure(cases, [ARCH], 16384, 132)
    launches = {}
    for name, args, kwargs, case in record_launches(cases):
        constexprs = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
        launches.setdefault((name, case.norm, json.dumps(constexprs, sort_keys=True)),
                            (args, kwargs))
    cuobjdump, nvdisasm = nvidia_tool("cuobjdump"), nvidia_tool("nvdisasm")
    for row in rows:
        args, kwargs = launches[(row["kernel"], row["norm"],
                                 json.dumps(row["constexprs"], sort_keys=True))]
        cap = {} if row["maxnreg"] is None else {"maxnreg": row["maxnreg"]}
        compiled = compile_launch(row["kernel"], args, {**kwargs, **cap}, ARCH)
        binary, kernel = compiled.asm["cubin"], compiled.metadata.name
        row["cuobjdump"] = cuobjdump and cuobjdump_resources(binary, kernel, cuobjdump)._asdict()
        row["sass"] = nvdisasm and dict(zip(("stores", "loads"),
                                            local_accesses(binary, nvdisasm), strict=True))
    print(json.dumps(rows))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
