"""launch/torchrun.sh ends a launch whose ranks explained themselves as they do: a user's
mistake is one ``error:`` line and exit 2 (an aborted run exit 3, a hang exit 4), with no
torchrun report; any other failure keeps torchrun's report (launch/torchrun_main.py). Ranks
still running after one such exit are left to end by themselves for a while, so that none is
stopped before it says the same mistake."""

import json
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from launch import torchrun_main
from pretrain.train.watchdog import HANG_EXIT
from tests.pretrain_fixtures import REPO, env, train_args

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


def _ranks(*exits: int | None):
    """torchrun's context of local ranks, as far as its poll reads it: each rank's exit code
    (None: still running). Its own poll, which would stop the running ranks, says "stopped"."""
    class Ranks:
        def __init__(self) -> None:
            self.subprocess_handlers = {
                rank: SimpleNamespace(proc=SimpleNamespace(poll=lambda code=code: code))
                for rank, code in enumerate(exits)}

        def _poll(self):
            return "stopped"

    torchrun_main.let_ranks_settle(Ranks)
    return Ranks()


@pytest.mark.parametrize("exits, settles", [
    ((2, None), True),  # a mistake: the other rank is about to say it too
    ((None, 3, None), True),
    ((HANG_EXIT, None), True),
    ((130, None), True),  # Ctrl-C: the other rank may still be saving
    ((1, None), False),  # a crash: the others are stopped at once, as torchrun does
    ((2, 1, None), False),
    ((2, STOPPED, None), False),
    ((2, 2), False),  # nothing left running: torchrun's poll reports them
    ((None, None), False),  # nothing failed: torchrun's poll says they run
])
def test_ranks_left_running_after_an_explained_exit_get_time_to_end(exits, settles):
    assert _ranks(*exits)._poll() == (None if settles else "stopped")


def test_the_time_they_get_runs_out(monkeypatch):
    monkeypatch.setattr(torchrun_main, "SETTLE_S", 0.0)
    assert _ranks(2, None)._poll() == "stopped"


EP_LINE = "error: parallel.ep (3) must divide model.num_experts (8)"


def _launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "launch" / "torchrun.sh"), "--nproc-per-node", "2",
                           *args], cwd=REPO, env={**env(), "PYTHON": sys.executable},
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_config_mistake_is_one_line_and_exit_2(data, tmp_path):
    """A user's case: experts that the expert-parallel size does not divide. Both ranks meet
    it: the launch says it in one ``error:`` line (not one per rank) and nothing else (no
    torchrun report or traceback, no rank stopped by torchrun before it said it), exit 2."""
    done = _launch(*train_args(data, tmp_path / "run", "--model.num_experts=8",
                               "--parallel.ep=3"))
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.splitlines() == [EP_LINE], done.stderr[-3000:]


@pytest.mark.slow
def test_a_rank_behind_says_the_mistake_before_it_is_stopped(data, tmp_path):
    """The same, with rank 0 reaching its config 3 s after rank 1 has failed on it: rank 0 is
    left to say the mistake itself (torchrun alone stops it at once, and it printed ``received
    SIGTERM: will stop ...`` before its ``error:`` line)."""
    done = subprocess.run(
        [sys.executable, str(REPO / "launch" / "torchrun_main.py"), "--standalone",
         "--nproc-per-node=2", "--max-restarts=0", "-m", "tests.late_rank", "3",
         *train_args(data, tmp_path / "run", "--model.num_experts=8", "--parallel.ep=3")],
        cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.splitlines() == [EP_LINE], done.stderr[-3000:]
