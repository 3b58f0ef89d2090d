"""launch/torchrun.sh ends a launch whose ranks explained themselves as they do: a user's
mistake is one ``error:`` line and exit 2 (an aborted run exit 3, a hang exit 4), with no
torchrun report; any other failure keeps torchrun's report (launch/torchrun_main.py)."""

import json
import signal
import subprocess
import sys

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from launch import torchrun_main
from pretrain.train.watchdog import HANG_EXIT
from tests.pretrain_fixtures import REPO, env

LINE = "error: optim.lr (-1.0) must be > 0"


def _failure(tmp_path, exits: dict[int, int], lines: dict[int, str] | None = None
             ) -> ChildFailedError:
    """torchrun's ChildFailedError for global ranks exiting with ``exits``; a rank in ``lines``
    wrote that line to its error file (as runtime.launcher.report_error does)."""
    lines = lines or {}
    failures = {}
    for rank, code in exits.items():
        error_file = tmp_path / f"error-{rank}.json"
        if rank in lines:
            error_file.write_text(json.dumps({"message": {
                "message": lines[rank], "extraInfo": {"timestamp": "1"}}}))
        failures[rank] = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code,
                                        error_file=str(error_file))
    return ChildFailedError("pretrain", failures)


STOPPED = -signal.SIGTERM  # a rank torchrun stopped after another one failed


@pytest.mark.parametrize("exits, status", [
    ({0: 2, 1: 2}, 2),
    ({0: 3, 1: 3}, 3),
    ({0: HANG_EXIT, 1: HANG_EXIT}, HANG_EXIT),  # every rank's watchdog ended it
    ({0: HANG_EXIT, 1: STOPPED}, HANG_EXIT),
    ({0: HANG_EXIT, 1: 1}, None),  # another rank crashed instead
    ({0: 2, 1: STOPPED}, 2),  # stopped by torchrun on its way out
    ({1: 2}, 2),
    ({0: 2, 1: 1}, None),  # a crash on another rank: torchrun's report
    ({0: 2, 1: 3}, None),
    ({0: 1}, None),
    ({0: STOPPED}, None),  # killed from outside
    ({0: -signal.SIGKILL, 1: 2}, None),
])
def test_which_failures_are_explained(tmp_path, exits, status):
    assert torchrun_main.explained_status(_failure(tmp_path, exits)) == status


def test_the_error_lines_ranks_wrote(tmp_path):
    failure = _failure(tmp_path, {0: STOPPED, 1: 2, 2: 2}, {1: LINE, 2: LINE})
    assert torchrun_main.error_lines(failure) == {1: LINE, 2: LINE}
    assert torchrun_main.error_lines(_failure(tmp_path, {0: 1})) == {}


@pytest.mark.parametrize("exits, lines, printed", [
    ({0: 2, 1: 2}, {0: LINE, 1: LINE}, ""),  # rank 0 printed it
    ({0: STOPPED, 1: 2}, {0: LINE, 1: LINE}, ""),  # rank 0 printed it, then was stopped
    ({0: STOPPED, 1: 2, 2: 2}, {1: LINE, 2: LINE}, LINE + "\n"),  # stopped before it said it
    ({1: 2}, {1: "error: only rank 1 met this"}, "error: only rank 1 met this\n"),
])
def test_the_launch_says_the_mistake_once(tmp_path, monkeypatch, capsys, exits, lines, printed):
    def run(_args):
        raise _failure(tmp_path, exits, lines)

    monkeypatch.setattr(torchrun_main, "run", run)
    assert torchrun_main.main(["--standalone", "-m", "pretrain"]) == 2
    assert capsys.readouterr().err == printed


def test_other_failures_keep_torchruns_report(tmp_path, monkeypatch):
    def run(_args):
        raise _failure(tmp_path, {0: 1, 1: STOPPED})

    monkeypatch.setattr(torchrun_main, "run", run)
    with pytest.raises(ChildFailedError):
        torchrun_main.main(["--standalone", "-m", "pretrain"])


def _launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "launch" / "torchrun.sh"), "--nproc-per-node", "2",
                           *args], cwd=REPO, env={**env(), "PYTHON": sys.executable},
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_config_mistake_is_one_line_and_exit_2():
    """Two ranks meet the same mistake: one ``error:`` line (not one per rank), exit 2, no
    torchrun report or traceback."""
    done = _launch("train", "--config", "configs/demo-cpu.toml", "--optim.lr=-1")
    assert done.returncode == 2, done.stderr[-3000:]
    assert [line for line in done.stderr.splitlines() if "error" in line.lower()] == [LINE], \
        done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "FAILED" not in done.stderr
