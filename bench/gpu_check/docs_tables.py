"""python -m bench.gpu_check.docs_tables [--write]

The GPU tables of README.md and docs/benchmarks.md, generated from the newest
``docs/results/gpu-*.json`` (a ``make gpu-check`` run's ``gpu-check.json``, committed under its
date), so no GPU figure in the docs stands without its file. Each table sits between
``<!-- gpu-results: NAME -->`` and ``<!-- /gpu-results -->``; ``--write`` replaces them, without
it the script exits 1 if a file is out of date (tests/bench/test_gpu_check.py holds them
equal).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from bench.gpu_check import report
from runtime.markdown import markdown_table, refresh_docs

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "docs" / "results"
STEP_SECTIONS = ("steps", "more_schemes", "optimizer")


def newest(folder: Path = RESULTS) -> Path:
    files = sorted(folder.glob("gpu-????-??-??.json"))
    if not files:
        raise SystemExit(f"bench.gpu_check.docs_tables: no gpu-YYYY-MM-DD.json in {folder}")
    return files[-1]


def step_rows(result: dict) -> list[tuple[dict, dict]]:
    """(row, its section's data) of every step measurement, in the file's order."""
    return [(row, result[name]) for name in STEP_SECTIONS if result.get(name)
            for row in result[name]["rows"]]


def pick(result: dict, scheme: str, field: str) -> tuple[dict, dict] | None:
    """The row of ``scheme`` with ``field`` at the largest micro-batch, the last such."""
    found = [(r, d) for r, d in step_rows(result) if r["scheme"] == scheme
             and r.get(field) is not None]
    return max(reversed(found), key=lambda rd: rd[0].get("micro_batch", 0)) if found else None


def _at(found: tuple[dict, dict] | None, text: Callable[[dict], str]) -> list[str]:
    if found is None:
        return ["not measured", ""]
    row, data = found
    return [text(row), report.setting(row, data)]


def _pre_rate(row: dict) -> str:
    return f"{row['tokens_per_s'] / 1e3:.1f}k, {report.mfu(row)} MFU"


def _best_pre(result: dict) -> tuple[dict, dict] | None:
    """The fastest pre at the greatest depth measured (the target is the full model's; a
    shallower model has more tokens/s)."""
    pres = [(r, d) for r, d in step_rows(result) if r["scheme"] == "pre"
            and r.get("tokens_per_s") is not None]
    return max(pres, key=lambda rd: (rd[0].get("layers") or rd[1].get("layers", 0),
                                     rd[0]["tokens_per_s"])) if pres else None


def _plain_norm(result: dict) -> list[str]:
    rows = {r["pass"]: r for r in result.get("norms", {}).get("rows", [])
            if r["op"].startswith("plain norm") and r["impl"] == "triton (fused)"
            and r.get("of_copy") is not None}
    if not rows:
        return ["not measured", ""]
    norms = result["norms"]
    text = ", ".join(f"{name} {rows[name]['of_copy']:.2f} of copy" for name in
                     ("fwd", "fwd+bwd") if name in rows)
    return [f"plain norm: {text}", f"{norms['tokens']} x {norms['hidden']}, {norms['dtype']}"]


def _optimizer(result: dict) -> list[str]:
    """AdamW's step against the target, Muon's beside it once measured."""
    part = result.get("optimizer", {})
    rows = [(r, part) for r in part.get("rows", []) if r.get("optimizer_ms") is not None]
    muon = [r for r in part.get("muon", {}).get("rows", []) if r.get("optimizer_ms") is not None]
    return _at(rows[-1] if rows else None, lambda r: f"{r['optimizer_ms']:.1f} ms" + (
        f" (Muon: {muon[-1]['optimizer_ms']:.1f} ms)" if muon else ""))


def _ratio(scheme: str, field: str) -> Callable[[dict], list[str]]:
    return lambda result: _at(pick(result, scheme, field), lambda r: f"{r[field]:.3f}")


TARGETS = [
    ("pre >= 65k tokens/s, >= 53% MFU", lambda res: _at(_best_pre(res), _pre_rate)),
    ("siamese step <= 1.02 x pre", _ratio("siamese", "step_ratio")),
    ("siamese_hybrid step <= 1.03 x pre", _ratio("siamese_hybrid", "step_ratio")),
    ("post step <= 1.03 x pre", _ratio("post", "step_ratio")),
    ("hybridnorm step <= 1.03 x pre", _ratio("hybridnorm", "step_ratio")),
    ("activation siamese <= 1.05 x pre", _ratio("siamese", "activation_ratio")),
    ("activation siamese_hybrid <= 1.08 x pre", _ratio("siamese_hybrid", "activation_ratio")),
    ("fused norms fwd+bwd >= 80% of copy BW", _plain_norm),
    ("optimizer step <= 12 ms at 1.2B parameters", _optimizer),
]


def targets_table(result: dict, name: str) -> str:
    rows = [[target, *measure(result)] for target, measure in TARGETS]
    return (f"From [{name}](docs/results/{name}) ([its page](docs/results/"
            f"{name.removesuffix('.json')}.md)):\n\n"
            + markdown_table(["target", "newest GPU measurement", "setting"], rows,
                             right_from=3))


def steps_table(result: dict) -> str:
    rows = [r for name in STEP_SECTIONS if result.get(name)
            for r in report.step_rows(result[name])]
    return markdown_table(report.STEP_COLUMNS, rows, right_from=2) if rows else "(none)"


def blocks(result: dict, name: str) -> dict[str, str]:
    """NAME -> generated text; README links are from the root, docs/ links one up."""
    env = result.get("environment", {})
    summary = (f"{result['date']}, {env.get('device', 'device not recorded')}, torch "
               f"{env.get('torch', '?')}, commit {env.get('commit') or 'not recorded'}"
               + (" (converted from an earlier report)" if result.get("source") == "converted"
                  else ""))
    targets = targets_table(result, name)
    return {"readme-targets": f"Newest GPU results: {summary}. {targets}",
            "benchmarks-targets": f"Newest GPU results: {summary}. "
                                  + targets.replace("](docs/results/", "](results/"),
            "benchmarks-steps": steps_table(result)}


DOCS = [REPO / "README.md", REPO / "docs" / "benchmarks.md"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help="rewrite the docs' tables")
    args = p.parse_args(argv)
    path = newest()
    generated = blocks(json.loads(path.read_text()), path.name)
    return refresh_docs(DOCS, "gpu-results", generated, path.name, args.write)

if __name__ == "__main__":
    sys.exit(main())
