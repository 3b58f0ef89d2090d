"""``tests.helpers.spawn``: CPU ranks come from a fork server started with the environment
they run in, also after the test process's environment changed."""

import json
import os
from pathlib import Path

import pytest

from tests.helpers import spawn

pytestmark = pytest.mark.slow  # starts processes


def _report(folder: str) -> None:
    Path(folder, os.environ["RANK"]).write_text(json.dumps(
        {"parent": os.getppid(), "probe": os.environ.get("SPAWN_PROBE")}))


def _spawned(folder: Path) -> list[dict]:
    folder.mkdir()
    spawn(2, _report, str(folder))
    return [json.loads((folder / str(rank)).read_text()) for rank in (0, 1)]


def test_a_changed_environment_gets_a_fork_server_of_its_own(tmp_path, monkeypatch):
    """A variable set in the test process (as torch's compile sets its cache folder) starts
    a new fork server with it, whose ranks see it; no rank is a fresh interpreter, whose
    parent would be this process."""
    first = _spawned(tmp_path / "first")
    monkeypatch.setenv("SPAWN_PROBE", "set")
    second = _spawned(tmp_path / "second")
    again = _spawned(tmp_path / "again")
    parents = [{rank["parent"] for rank in ranks} for ranks in (first, second, again)]
    assert all(len(p) == 1 and os.getpid() not in p for p in parents), parents
    assert parents[0] != parents[1] == parents[2]  # a new server, then that one serving on
    assert [r["probe"] for r in first] == [None, None]
    assert [r["probe"] for r in second + again] == ["set"] * 4
