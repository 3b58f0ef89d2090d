"""A pytest plugin that writes every test's outcome to a JSON-lines file as the test ends
(``-p bench.gpu_check.outcomes --outcomes=FILE``): the collected test ids first, then one line
per test. A run killed at its time budget leaves every outcome it reached."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--outcomes", help="JSON-lines file each test's outcome is appended to")


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("outcomes")
    if path:
        config.pluginmanager.register(Recorder(Path(path)), "gpu-check-outcomes")


class Recorder:
    def __init__(self, path: Path) -> None:
        self.path = path

    def _append(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self._append({"collected": [item.nodeid for item in session.items]})

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """One line per test: its call's outcome, or its set-up's when that did not pass
        (a skip or an error), or its tear-down's error."""
        decisive = (report.when == "call" or (report.when == "setup" and not report.passed)
                    or (report.when == "teardown" and report.failed))
        if not decisive:
            return
        outcome = report.outcome if report.when == "call" or report.skipped else "error"
        self._append({"id": report.nodeid, "outcome": outcome,
                      "seconds": round(report.duration, 2), "message": _message(report)})


def _message(report: pytest.TestReport) -> str:
    """A skip's reason, or the last line of a failure (its assertion or exception)."""
    if report.passed:
        return ""
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    lines = str(report.longrepr).strip().splitlines()
    return lines[-1][:500] if lines else ""
