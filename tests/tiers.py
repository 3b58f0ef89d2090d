"""The test tiers, enforced rather than remembered.

``make test-fast`` runs ``-m "not slow and not gpu and not cluster"``. A tier is only as good
as its markers, so the suite checks them as it runs: starting a process (``subprocess``, or a
``multiprocessing`` child as ``torch.multiprocessing`` starts ranks) from a test not marked
``slow`` fails that test, and the slurm and network-namespace clusters refuse tests not marked
``cluster``. A session fixture that starts processes counts against the first test that asks
for it, so every test using one is ``slow`` too.

conftest.py calls :func:`enter` and :func:`leave` around each test (set-up, call and
tear-down) and :func:`install` once.
"""

from __future__ import annotations

import multiprocessing.process
import subprocess

import pytest

_current: pytest.Item | None = None


def enter(item: pytest.Item) -> None:
    global _current
    _current = item


def leave() -> None:
    global _current
    _current = None


def require(marker: str, what: str) -> None:
    """Fail the running test unless it carries ``marker`` (outside a test: allowed)."""
    if _current is not None and _current.get_closest_marker(marker) is None:
        raise pytest.fail.Exception(
            f"{_current.nodeid} {what} but is not marked @pytest.mark.{marker} "
            f"(tests/tiers.py: the fast tier must not)")


def install() -> None:
    """Wrap the two ways a test starts a process so each asks :func:`require` first."""
    popen_init = subprocess.Popen.__init__
    process_start = multiprocessing.process.BaseProcess.start

    def checked_popen_init(self, args, *rest, **kwargs):
        require("slow", f"starts a process ({_command(args)})")
        popen_init(self, args, *rest, **kwargs)

    def checked_start(self):
        require("slow", f"starts a multiprocessing child ({self.name})")
        process_start(self)

    subprocess.Popen.__init__ = checked_popen_init
    multiprocessing.process.BaseProcess.start = checked_start


def _command(args) -> str:
    words = [args] if isinstance(args, str | bytes) else list(args)
    return " ".join(str(w)[:60] for w in words[:4])
