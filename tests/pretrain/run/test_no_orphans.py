"""No process outlives a run, whichever way it ends: finished, failed, stopped by SIGTERM or
Ctrl-C to its process group in the middle of a save, or exited at once by a second Ctrl-C
there (foreground or background save); and the next start removes the folder that cut short
save left. Each run carries a marker in its environment, which every process it starts
inherits (forked writers, spawned helpers), so what is left is found however it was started."""

import os
import resource
import signal
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from pretrain.run import checkpoint
from tests.pretrain_fixtures import in_session, train_args

pytestmark = pytest.mark.slow

MARK = "SIAMESENORM_TEST_RUN"
INTERRUPTED = 130
TWICE = "error: interrupted again by Ctrl-C: exited at once without saving; the checkpoints " \
        "already written are kept"


def _marked(token: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get(MARK) == token:
                found.append(proc)
        except psutil.Error:  # gone meanwhile, or another user's
            continue
    return found


def _left_behind(token: str, grace: float = 10.0) -> list[str]:
    """The processes of the run still alive ``grace`` seconds after it exited, described;
    killed, so that a failing test leaves none either."""
    deadline = time.monotonic() + grace
    while (procs := _marked(token)) and time.monotonic() < deadline:
        time.sleep(0.1)
    described = []
    for proc in procs:
        try:
            described.append(f"pid {proc.pid} (parent {proc.ppid()}, "
                             f"{proc.memory_info().rss >> 20} MiB): "
                             f"{' '.join(proc.cmdline())[:160]}")
            proc.kill()
        except psutil.Error:
            continue
    return described


def _run(cmd: list[str], log: Path, **popen_kwargs) -> tuple[int, str, list[str]]:
    """``cmd`` in its own session, to its end: exit status, output, and what it left running."""
    token = uuid.uuid4().hex
    proc = in_session(cmd, log, {MARK: token}, **popen_kwargs)
    try:
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return code, log.read_text(), _left_behind(token)


def _signal_in_save(step: int, args: list[str], name: str, background: bool) -> list[str]:
    return [sys.executable, "-m", "tests.kill_in_save", *(["--background"] * background),
            "--signal", name, str(step), *args]


def _train(*args: str) -> list[str]:
    return [sys.executable, "-m", "pretrain", *args]


def _lines(output: str, text: str) -> int:
    return sum(text in line for line in output.splitlines())


@pytest.mark.parametrize("background", [False, True], ids=["foreground", "background"])
def test_a_second_ctrl_c_in_a_save_leaves_no_process_and_the_next_start_its_folder(
        data, tmp_path, background):
    """Ctrl-C twice while step 2 is being saved: one error line, exit 130, nothing running
    (megatron's result queue was a Manager process that survived this as an orphan; a
    background writer is killed with the run). The cut short save is .step_2.tmp; the next
    start, which never saves step 2, removes it and ends leaving nothing running either."""
    run = tmp_path / "run"
    args = train_args(data, run, "--run.steps=3", "--run.save_interval=2",
                      "--run.eval_interval=100", *(["--run.async_save=true"] * background))
    code, output, left = _run(_signal_in_save(2, args, "SIGINT-twice", background),
                              tmp_path / "interrupted.log")
    assert code == INTERRUPTED, output[-3000:]
    assert left == [], left
    assert "Traceback" not in output, output[-3000:]
    assert _lines(output, "error:") == 1 and _lines(output, TWICE) == 1, output[-3000:]
    assert _lines(output, "received Ctrl-C (SIGINT)") == 1, output[-3000:]
    partial = run / "checkpoints" / ".step_00000002.tmp"
    assert list(partial.glob("*.distcp")), output[-3000:]  # the tensors were written
    assert checkpoint.resolve(run / "checkpoints") is None

    code, output, left = _run(_train(*train_args(data, run, "--run.steps=1",
                                                 "--optim.warmup_steps=0")),
                              tmp_path / "next.log")
    assert code == 0, output[-3000:]
    assert left == [], left
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest",
                                                                       "step_00000001"]
    assert f"removed {partial}, left by a save that did not complete" in output


@pytest.mark.parametrize("sig, background", [(signal.SIGTERM, False), (signal.SIGTERM, True),
                                             (signal.SIGINT, True)],
                         ids=["SIGTERM-foreground", "SIGTERM-background", "SIGINT-background"])
def test_a_stop_signal_to_the_group_saves_and_leaves_no_process(data, tmp_path, sig,
                                                                 background):
    """SIGTERM (slurm sends it to every process of the job) or Ctrl-C (a terminal, to the
    whole group) in step 2's save: the run saves at its next step and stops, said once, with
    nothing left running. In the background the signal comes while the forked writer is in
    flight: the writer, which inherits the handler, ignores it and finishes. (megatron's
    Manager process died of the SIGTERM, and the stop checkpoint with it.)"""
    run = tmp_path / "run"
    args = train_args(data, run, "--run.steps=100", "--run.save_interval=2",
                      "--run.eval_interval=100", *(["--run.async_save=true"] * background))
    code, output, left = _run(_signal_in_save(2, args, sig.name, background),
                              tmp_path / "stop.log")
    assert code == (INTERRUPTED if sig == signal.SIGINT else 0), output[-3000:]
    assert left == [], left
    said = "Ctrl-C (SIGINT)" if sig == signal.SIGINT else sig.name
    assert _lines(output, f"received {said}") == 1, output[-3000:]
    latest = (run / "checkpoints" / "latest").read_text()
    step = int(latest.removeprefix("step_"))
    assert step > 2 and _lines(output, f"stopped by {said} after step {step};") == 1, \
        output[-3000:]


def test_a_failed_run_leaves_no_process(data, tmp_path):
    """Files capped at 64 KB (the checkpoint's shard is larger): the first save fails, exit 2."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    run = tmp_path / "run"
    code, output, left = _run(_train(*train_args(data, run, "--run.steps=1",
                                                 "--optim.warmup_steps=0")),
                              tmp_path / "failed.log", preexec_fn=limit)
    assert code == 2, output[-3000:]
    assert left == [], left
    assert _lines(output, "saving checkpoint step 1") == 1, output[-3000:]
