"""``pytest -p tests.kernels.bounds_plugin --bounds-report=FILE``: every Triton launch the
session interprets is bounds-checked (:mod:`tests.kernels.bounds`), and what the check saw is
written to FILE as JSON when the session ends.

A plugin rather than a fixture so that whole test files run under the check as they are, with
their own shapes and launches: the check covers every launch the kernel tests make, not a copy
of them. Its tests still pass or fail on their own; the report is read by whoever started the
session (tests/kernels/test_kernel_bounds.py)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.kernels import bounds

_STATE: dict = {}


def pytest_addoption(parser):
    parser.addoption("--bounds-report", type=Path, required=True,
                     help="where to write the bounds check's JSON report")


def pytest_configure(config):
    context = bounds.checked()
    _STATE.update(context=context, report=context.__enter__(),
                  path=config.getoption("--bounds-report"))


def pytest_unconfigure(config):
    if "context" not in _STATE:
        return
    report = _STATE["report"]
    _STATE.pop("context").__exit__(None, None, None)
    _STATE["path"].write_text(json.dumps({
        "launches": dict(report.launches), "variants": len(report.variants),
        "accesses": report.accesses, "lanes": report.lanes,
        "violations": report.violations}, indent=1) + "\n")
