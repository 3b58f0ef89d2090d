"""The markdown page of a GPU check's result (``gpu-check.md``, and ``docs/results/gpu-*.md``):
what ran where, every figure, and what was not run and why. Written from the JSON alone, so a
result converted from an earlier report reads the same way."""

from __future__ import annotations

from runtime.markdown import markdown_table


def _num(value, spec: str = ",.1f", suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def _pct(value) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def header(result: dict) -> list[str]:
    env = result.get("environment", {})
    packages = env.get("packages", {})
    kind = ("a rehearsal on the CPU at tiny shapes: its figures mean nothing but that the code "
            "runs" if result.get("rehearsal") else
            "converted from an earlier report, not run by the check" if
            result.get("source") == "converted" else "a `make gpu-check` run")
    commit = env.get("commit") or "not recorded"
    lines = [f"# GPU check of {result['date']}", "",
             f"What: {kind}. Device: {env.get('device', 'not recorded')}"
             + (f" ({env['sms']} SMs, {env['memory_gib']} GiB)" if env.get("sms") else "")
             + (f", driver {env['driver']}" if env.get("driver") else "") + ".",
             f"Versions: Python {env.get('python', '?')}, torch {env.get('torch', '?')}"
             + (f" (CUDA {env['cuda']})" if env.get("cuda") else "")
             + "".join(f", {name} {version}" for name, version in packages.items()) + ".",
             f"Commit: {commit}" + (" (tree changed since)" if env.get("tree_changed") else "")
             + (f" ({env['commit_from']})" if env.get("commit_from") else "") + "."]
    if result.get("note"):
        lines += ["", result["note"]]
    return lines


def parts_table(result: dict) -> list[str]:
    rows = [[name, p.get("title", ""), p.get("status", "?"), p.get("reason") or p.get("error")
             or "", _num(p.get("seconds"), ".0f")] for name, p in result["parts"].items()]
    return ["", "## Parts", "", markdown_table(["part", "what", "status", "why", "s"], rows,
                                               right_from=4)]


def calibration(data: dict) -> list[str]:
    return ["", "## Calibration", "",
            f"Device copy {_num(data.get('copy_gbs'), ',.0f')} GB/s (read + write); "
            f"{data.get('gemm', 'GEMM')} {_num(data.get('gemm_tflops'))} TFLOP/s."]


def tests(data: dict) -> list[str]:
    counts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(data["counts"].items()))
    rows = [[f"`{t['id']}`", t["outcome"], (t.get("message") or "").replace("|", "/")[:160],
             _num(t.get("seconds"), ".1f")] for t in data["tests"]]
    stopped = " (stopped at the part's budget)" if data.get("stopped_at_budget") else ""
    return ["", "## Correctness tests", "", f"`{data['command']}`{stopped}: {counts}.", "",
            markdown_table(["test", "outcome", "message", "s"], rows, right_from=3)]


def norms(data: dict) -> list[str]:
    rows = [[r["op"], r["pass"], r["impl"], _num(r.get("ms"), ".3f") if r.get("ms") else
             f"failed ({r.get('error', '?')})", _num(r.get("gbs"), ",.0f"),
             _pct(r.get("of_copy"))] for r in data["rows"]]
    return ["", "## Fused norms", "",
            f"{data['tokens']} tokens x {data['hidden']}, {data['dtype']}, {data['norm']}; "
            f"device copy {_num(data.get('copy_gbs'), ',.0f')} GB/s.", "",
            markdown_table(["op", "pass", "implementation", "ms", "GB/s", "of copy"], rows,
                           right_from=3)]


STEP_COLUMNS = ["scheme", "setting", "step ms", "step / pre", "tokens/s", "MFU",
                "optimizer ms", "activation GiB", "activation / pre", "peak GiB"]


def setting(row: dict, data: dict) -> str:
    if row.get("setting"):
        return row["setting"]
    return (f"{data['layers']} x {data['hidden']}, seq {data['seq']}, micro-batch "
            f"{row['micro_batch']}, {data['dtype']}")


def mfu(row: dict) -> str:
    """MFU, with its formula where it is not Megatron-LM's (rows converted from old reports)."""
    formula = row.get("mfu_formula", "Megatron-LM")
    return _pct(row.get("mfu")) + ("" if formula == "Megatron-LM" or row.get("mfu") is None
                                   else f" ({formula})")


def step_rows(data: dict) -> list[list[str]]:
    return [[r["scheme"], setting(r, data), _num(r.get("step_ms")), _num(r.get("step_ratio"),
             ".3f"), _num(r.get("tokens_per_s"), ",.0f"), mfu(r),
             _num(r.get("optimizer_ms")), _num(r.get("activation_gib"), ".2f"),
             _num(r.get("activation_ratio"), ".3f"), _num(r.get("peak_gib"), ".2f")]
            for r in data["rows"]]


def steps(title: str, data: dict) -> list[str]:
    rounds = data.get("rounds_done")
    lines = ["", f"## {title}", ""]
    if rounds is not None:
        lines += [f"Medians over {rounds} complete round(s) of {data['layers']} layers; MFU by "
                  "Megatron-LM's formula; activation = peak in fwd+bwd minus weights, gradients "
                  "and optimizer state.", ""]
    lines.append(markdown_table(STEP_COLUMNS, step_rows(data), right_from=2))
    if data.get("table"):
        lines += ["", "GPU kernels per step, side by side:", "", data["table"]]
    return lines


def alternatives(data: dict) -> list[str]:
    rows = [[str(r["hidden"]), r["layout"], r["op"], _num(r.get("ms"), ".3f"),
             _num(r.get("gbs"), ",.0f"), _pct(r.get("of_copy"))] for r in data["rows"]]
    return ["", "## Backward kernel layouts (fwd+bwd)", "",
            f"{data['tokens']} rows, {data['dtype']}, rmsnorm.", "",
            markdown_table(["hidden", "layout", "op", "ms", "GB/s", "of copy"], rows,
                           right_from=3)]


def compiled(data: dict) -> list[str]:
    """The compiled rows (and CUDA-graph rows) as step tables, compile seconds added."""
    lines = []
    for name, title in (("compiled", "Compiled blocks"),
                        ("compiled_cuda_graphs", "Compiled blocks with CUDA graphs")):
        if name in data:
            lines += steps(title, data[name])
            lines += ["", "Compile seconds (warm-up steps): " + ", ".join(
                f"{r['scheme']} {_num(r.get('compile_s'))}" for r in data[name]["rows"])]
    return lines


SECTIONS = {"calibration": calibration, "tests": tests, "norms": norms,
            "steps": lambda d: steps("Step table", d),
            "moe": lambda d: steps("Mixture of experts (targets: siamese/pre step <= 1.005, "
                                   "activation <= 1.02)", d),
            "more_schemes": lambda d: steps("More schemes", d),
            "optimizer": lambda d: steps("Optimizer step at the full depth", d)
            + (steps("The same with Muon (optim.name muon)", d["muon"]) if "muon" in d else []),
            "profile": lambda d: steps("Profile of siamese against pre", d),
            "kernel_alternatives": alternatives,
            "compiled": compiled}


def not_run(result: dict) -> list[str]:
    lines = [f"- {name}: {p.get('status')}: {p.get('reason') or p.get('error')}"
             for name, p in result["parts"].items()
             if p.get("status") not in ("done", "converted")]
    lines += [f"- {name}: {item}" for name in SECTIONS
              for item in result.get(name, {}).get("not_run", [])]
    lines += [f"- {item}" for item in result.get("not_recorded", [])]
    return ["", "## Not run, and why", "", *(lines or ["- nothing: every part ran in full"])]


def markdown(result: dict) -> str:
    lines = header(result) + parts_table(result)
    for name, section in SECTIONS.items():
        if result.get(name):
            lines += section(result[name])
    return "\n".join(lines + not_run(result)) + "\n"
