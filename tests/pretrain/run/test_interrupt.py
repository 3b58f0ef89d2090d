"""Ctrl-C as a user presses it: SIGINT to the whole process group of a CLI child, alone and
under the torchrun launcher; the first saves and stops, a second exits at once, and the other
commands stop in one line."""

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.pretrain_fixtures import (
    REPO,
    catches,
    cli,
    in_session,
    metrics,
    train_args,
    wait_for,
)

pytestmark = pytest.mark.slow

INTERRUPTED = 130  # 128 + SIGINT, what a shell expects of an interrupted command
STOPPED = "stopped by Ctrl-C (SIGINT) after step {}; checkpoint saved; run the same command " \
          "to resume"


def _trained(run: Path, steps: int) -> bool:
    return (run / "metrics.jsonl").is_file() and \
        sum("loss" in r for r in metrics(run)) >= steps


def _interrupt_training(cmd: list[str], run: Path, log: Path) -> tuple[int, str]:
    proc = in_session(cmd, log)
    try:
        wait_for(lambda: proc.poll() is not None or _trained(run, 2), "two steps", 240)
        assert proc.poll() is None, log.read_text()[-2000:]
        os.killpg(proc.pid, signal.SIGINT)
        return proc.wait(timeout=240), log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _saved_step(run: Path) -> int:
    return int((run / "checkpoints" / "latest").read_text().removeprefix("step_"))


def _assert_stopped_once(code: int, output: str, run: Path) -> int:
    assert code == INTERRUPTED, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    step = _saved_step(run)
    assert output.count(STOPPED.format(step)) == 1, output[-2000:]
    assert (run / "checkpoints" / f"step_{step:08d}" / "complete.json").is_file()
    return step


def test_ctrl_c_saves_stops_in_one_line_and_resumes(data, tmp_path):
    run = tmp_path / "run"
    args = train_args(data, run, "--run.steps=100000", "--run.save_interval=0",
                      "--data.valid_samples=0")
    code, output = _interrupt_training([sys.executable, "-m", "pretrain", *args], run,
                                       tmp_path / "train.log")
    step = _assert_stopped_once(code, output, run)
    assert not (run / "run.lock").exists()
    resumed = cli(*train_args(data, run, f"--run.steps={step + 2}", "--run.save_interval=0",
                              "--data.valid_samples=0", "--optim.override_schedule=true"))
    assert f"resuming from {run / 'checkpoints' / f'step_{step:08d}'}" in resumed.stderr
    assert _saved_step(run) == step + 2


def test_ctrl_c_under_torchrun_stops_every_rank_after_a_save(data, tmp_path):
    run = tmp_path / "run"
    args = train_args(data, run, "--run.steps=100000", "--run.save_interval=0",
                      "--data.valid_samples=0")
    code, output = _interrupt_training(
        [str(REPO / "launch" / "torchrun.sh"), "--nproc-per-node", "2", *args], run,
        tmp_path / "torchrun.log")
    _assert_stopped_once(code, output, run)
    assert "death signal" not in output and "ChildFailedError" not in output, output[-3000:]


def test_the_first_ctrl_c_promises_what_a_second_press_does(data, tmp_path):
    """The first press's line says when a second one exits at once; a press inside that
    interval is the same press (the run saves and stops), as the line says."""
    run = tmp_path / "run"
    log = tmp_path / "train.log"
    args = train_args(data, run, "--run.steps=100000", "--run.save_interval=0",
                      "--data.valid_samples=0")
    proc = in_session([sys.executable, "-m", "pretrain", *args], log)
    try:
        wait_for(lambda: proc.poll() is not None or _trained(run, 2), "two steps", 240)
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.2)  # well inside the second the line gives
        os.killpg(proc.pid, signal.SIGINT)
        code, output = proc.wait(timeout=240), log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert ("received Ctrl-C (SIGINT): will stop at the next step boundary and save; Ctrl-C "
            "again, 1 s or more after this one, exits at once without saving (a press within "
            "1 s is taken as this one)") in output, output[-2000:]
    _assert_stopped_once(code, output, run)
    assert "interrupted again" not in output


def test_a_second_ctrl_c_exits_at_once_without_a_traceback(data, tmp_path):
    """The second press (a second after the first) during start-up: no waiting for the
    start-up's next boundary, one line, nothing written."""
    run = tmp_path / "run"
    log = tmp_path / "train.log"
    proc = in_session([sys.executable, "-m", "pretrain", *train_args(data, run)], log)
    wait_for(lambda: catches(proc.pid, signal.SIGUSR1), "the stop handler")  # before torch
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(1.2)
    os.killpg(proc.pid, signal.SIGINT)
    code, output = proc.wait(timeout=120), log.read_text()
    assert code == INTERRUPTED, output[-2000:]
    assert "Traceback" not in output, output[-3000:]
    assert "error: interrupted again by Ctrl-C: exited at once without saving" in output
    assert not run.exists()


def test_ctrl_c_in_eval_is_one_line(data, tmp_path):
    run = tmp_path / "run"
    cli(*train_args(data, run, "--run.steps=3"))
    log = tmp_path / "eval.log"
    proc = in_session([sys.executable, "-m", "pretrain", "eval", "--checkpoint",
                   str(run / "checkpoints")], log)
    wait_for(lambda: proc.poll() is not None or "libtorch" in Path(
        f"/proc/{proc.pid}/maps").read_text(), "torch to load")
    os.killpg(proc.pid, signal.SIGINT)
    code, output = proc.wait(timeout=120), log.read_text()
    assert code == INTERRUPTED, output[-2000:]
    assert "Traceback" not in output, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert errors == ["error: interrupted by Ctrl-C: eval stopped; nothing half-written is "
                      "left"], output[-2000:]
    assert not (run / "eval.jsonl").exists()
