"""The kernel tests' bounds check: a module that asks for it runs every Triton launch of its
tests checked address by address against the launch's tensors (tests/kernels/bounds.py),
where the kernels run in Triton's interpreter, so the kernel tests themselves, with their own
odd shapes, are the bounds check's cases (on a GPU the kernels run compiled: nothing to read).
The check costs those modules about a quarter more (85 s against 68 s), so a session that
deselects slow tests (the fast tier) runs them unchecked; the full suite checks them.
"""

import os

import pytest

from tests.kernels import bounds


@pytest.fixture(scope="module")
def bounds_report(request):
    """What the check saw over the module's tests so far; None where kernels are compiled,
    and in a session that deselects slow tests."""
    fast_tier = "not slow" in (request.config.getoption("markexpr") or "")
    if os.environ.get("TRITON_INTERPRET") != "1" or fast_tier:
        yield None
        return
    with bounds.checked() as report:
        yield report


@pytest.fixture
def inside_bounds(bounds_report):
    """Fails the test one of whose launches loaded or stored outside its tensors."""
    seen = len(bounds_report.violations) if bounds_report is not None else 0
    yield
    if bounds_report is not None:
        assert bounds_report.violations[seen:] == []
