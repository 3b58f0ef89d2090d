"""Hangs and stragglers: the watchdog's deadline rule (pretrain/train/watchdog.py) and the
per-rank step-time comparison (pretrain/train/stragglers.py) as functions; the watchdog in a
bare process, hung with the GIL free and with it held; and real 2-rank runs with rank 1 hung
or slow (tests/stall_rank.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from pretrain.config import load_config
from pretrain.run import checkpoint
from pretrain.train.stragglers import StepClock, slowest
from pretrain.train.watchdog import (
    HANG_EXIT,
    STEP_FLOOR_S,
    WARMUP_STEPS,
    Watchdog,
    linger,
    step_budget,
)
from runtime.errors import ConfigError
from tests.pretrain_fixtures import REPO, cli, env, metrics, train_args

# -- the deadline rule -------------------------------------------------------------------------


def test_the_budget_is_the_timeout_until_warm():
    for steps in range(WARMUP_STEPS):
        assert step_budget([0.1] * steps, 1800.0) == 1800.0


@pytest.mark.parametrize("recent, timeout, budget", [
    ([0.5] * 10, 1800.0, STEP_FLOOR_S),  # fast steps: the floor
    ([60.0] * 10, 1800.0, 600.0),  # 10 x the median
    ([600.0] * 10, 1800.0, 1800.0),  # never above run.hang_timeout
    ([0.5] * 10, 60.0, 60.0),  # a timeout under the floor bounds every step
    ([40.0] * 8 + [1000.0] * 2, 1800.0, 400.0),  # slow outliers (first steps) move no median
    ([1000.0] * 3 + [40.0] * 97, 1800.0, 400.0),
])
def test_a_warm_step_gets_ten_medians_floored_and_capped(recent, timeout, budget):
    assert step_budget(recent, timeout) == budget


@pytest.mark.parametrize("median", [0.01, 1.0, 30.0, 170.0])
def test_a_fired_rank_outwaits_one_step_of_its_peers(median):
    """The ranks blocked with a hung one finished their last step at most a step later."""
    assert linger(step_budget([median] * WARMUP_STEPS, 1800.0)) >= median


def _watchdog_threads() -> int:
    return sum(t.name == "pretrain-watchdog" for t in threading.enumerate())


def test_a_zero_timeout_starts_nothing(tmp_path):
    watchdog = Watchdog(0.0, tmp_path / "hangs", 0)
    assert _watchdog_threads() == 0
    watchdog.step_done(1)
    with watchdog.long("validation at step 1"):
        pass
    watchdog.stop()
    assert not (tmp_path / "hangs").exists()


def test_stop_ends_the_thread(tmp_path):
    watchdog = Watchdog(600.0, tmp_path / "hangs", 0)
    assert _watchdog_threads() == 1
    watchdog.step_done(1)
    with watchdog.long("validation at step 1"):
        pass
    watchdog.stop()
    assert _watchdog_threads() == 0


@pytest.mark.parametrize("override, message", [
    ("--run.hang_timeout=-1", "run.hang_timeout (-1.0) must be >= 0 seconds (0: no watchdog)"),
    ("--run.hang_timeout=inf", "run.hang_timeout (inf) must be a finite number"),
    ("--run.straggler_ratio=1", "run.straggler_ratio (1.0) must be > 1"),
    ("--run.straggler_ratio=0.5", "run.straggler_ratio (0.5) must be > 1"),
])
def test_bad_settings_are_one_line(override, message):
    with pytest.raises(ConfigError) as caught:
        load_config(None, [override])
    assert str(caught.value) == message


def test_zero_turns_the_watchdog_off():
    assert load_config(None, ["--run.hang_timeout=0"]).run.hang_timeout == 0.0


# -- the straggler report ----------------------------------------------------------------------


@pytest.mark.parametrize("times, rank, ratio", [
    ([0.2, 0.2, 0.9, 0.2], 2, 4.5),
    ([1.0, 3.0], 1, 1.5),  # two ranks: the median is their mean
    ([0.3], 0, 1.0),
    ([0.0, 0.0], 0, 1.0),
])
def test_the_slowest_rank_and_its_ratio_to_the_median(times, rank, ratio):
    fields = slowest(times)
    assert fields["slowest_rank"] == rank and fields["step_time_max"] == max(times)
    assert fields["slowest_ratio"] == pytest.approx(ratio)


def test_a_step_is_timed_to_its_gradient_synchronisation():
    """What a rank waits for in the synchronisation (a slower peer) is not its step time."""
    synced = []

    def finalize(*args, **kwargs):
        synced.append((args, kwargs))
        time.sleep(0.2)  # waiting in the all-reduce for a slow peer

    config = SimpleNamespace(finalize_model_grads_func=finalize)
    clock = StepClock([SimpleNamespace(config=config)])
    for own in (0.6, 0.05, 0.15):  # the first step (one-time set-up) is not timed
        clock.begin()
        time.sleep(own)
        config.finalize_model_grads_func([1], None, force_all_reduce=False)
    assert synced == [(([1], None), {"force_all_reduce": False})] * 3
    assert 0.1 <= clock.take() < 0.2  # the mean of 0.05 and 0.15
    assert clock.take() is None  # nothing since


# -- the watchdog in a bare process ------------------------------------------------------------

HEALTHY_THEN = """
import re, sys, time
from pathlib import Path
from pretrain.train.watchdog import Watchdog

def stuck_sleeping():
    time.sleep(120)

def stuck_holding_the_gil():
    re.match(r"(a+)+$", "a" * 64 + "b")  # the regular expression engine never lets go

watchdog = Watchdog(1.0, Path(sys.argv[1]), 3)
for step in range(1, 11):  # 3 s of steps, more than run.hang_timeout: each pushes the deadline
    time.sleep(0.3)
    watchdog.step_done(step)
print("10 steps", flush=True)
{"sleep": stuck_sleeping, "gil": stuck_holding_the_gil}[sys.argv[2]]()
"""


def _bare(tmp_path: Path, how: str) -> tuple[subprocess.CompletedProcess, float]:
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-c", HEALTHY_THEN, str(tmp_path / "hangs"), how],
                          cwd=REPO, env=env(), capture_output=True, text=True, timeout=60)
    return done, time.monotonic() - began


@pytest.mark.slow
def test_a_hung_process_writes_its_stacks_and_exits_4(tmp_path):
    done, took = _bare(tmp_path, "sleep")
    assert done.returncode == HANG_EXIT, done.stderr[-2000:]
    assert done.stdout == "10 steps\n"  # the steps kept it alive
    assert took < 15, took
    (dump,) = (tmp_path / "hangs").glob("rank3-*.txt")
    text = dump.read_text()
    assert text.startswith("rank 3 (pid ") and "step 11 made no progress within 1 s" in text
    assert "in stuck_sleeping" in text and "in _fire" in text  # every thread
    line = [x for x in done.stderr.splitlines() if "made no progress" in x]
    assert len(line) == 1 and str(dump) in line[0] and "exiting with status 4" in line[0]


@pytest.mark.slow
def test_a_process_stuck_holding_the_gil_still_dumps_and_exits(tmp_path):
    """No Python thread can run: faulthandler's C timer writes the stacks to stderr."""
    done, took = _bare(tmp_path, "gil")
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stdout == "10 steps\n"
    assert took < 25, took
    assert "in stuck_holding_the_gil" in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "hangs").exists()


# -- real runs on two gloo ranks ---------------------------------------------------------------


def _marked(marker: str) -> list[int]:
    """The processes whose environment holds ``marker``: every descendant of a launch, in
    whichever session (torchrun starts each rank in its own)."""
    found = []
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if proc.name.isdigit() and marker.encode() in (proc / "environ").read_bytes():
                found.append(int(proc.name))
    return found


def _launch(mode: str, n: str, args: list[str], log: Path, timeout: int = 300):
    """``tests.stall_rank MODE N ARGS`` on 2 ranks through launch/torchrun_main.py, output to
    ``log``; returns the finished process (stderr: the log), its wall time and the processes
    of the launch still alive 10 s after it ended (then killed)."""
    cmd = [sys.executable, str(REPO / "launch" / "torchrun_main.py"), "--standalone",
           "--nproc-per-node=2", "-m", "tests.stall_rank", mode, n, *args]
    marker = f"STALL_RANK_LAUNCH={uuid.uuid4().hex}"
    began = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env(**dict([marker.split("=")])),
                                stdout=out, stderr=out)
    try:
        proc.wait(timeout=timeout)
        took = time.monotonic() - began
        deadline = time.monotonic() + 10
        while _marked(marker) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = _marked(marker)
    finally:
        proc.kill()
        for pid in _marked(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    done = subprocess.CompletedProcess(cmd, proc.returncode, "", log.read_text())
    return done, took, left


@pytest.mark.slow
def test_a_hung_rank_ends_the_job_with_every_ranks_stacks(data, tmp_path):
    run = tmp_path / "run"
    args = train_args(data, run, "--run.steps=8", "--run.save_interval=2",
                      "--data.valid_samples=0", "--run.hang_timeout=30")
    done, took, left = _launch("hang", "5", args, tmp_path / "hung.log")
    assert done.returncode == HANG_EXIT, done.stderr[-3000:]
    # start-up, 4 steps, 2 saves (the first starts megatron's writer: 10 s here, so a shorter
    # run.hang_timeout ends this run in that save), 30 s and 3 s of linger
    assert took < 180, took
    assert not left, left  # no child process (a checkpoint writer) outlives its rank
    assert "ChildFailedError" not in done.stderr  # the ranks explained it: no torchrun report
    dumps = {p.name.split("-")[0]: p.read_text() for p in (run / "hangs").glob("rank*-*.txt")}
    assert sorted(dumps) == ["rank0", "rank1"], sorted(dumps)
    assert "in hang_forever" in dumps["rank1"]  # rank 1 sleeps in its step
    assert "in finalize_grads" in dumps["rank0"]  # rank 0 waits for it in the all-reduce
    for rank in (0, 1):
        assert f"rank {rank}: the step after the checkpoint of step 4 made no progress within " \
               f"30 s (run.hang_timeout 30 s); stacks written to {run / 'hangs'}" in done.stderr
    # the last complete checkpoint (a save in flight at the hang may be lost) resumes
    latest = checkpoint.resolve(run / "checkpoints")
    assert latest is not None and latest.name in ("step_00000002", "step_00000004"), latest
    cli(*args)
    assert checkpoint.resolve(run / "checkpoints").name == "step_00000008"
    resumed = [r["step"] for r in metrics(run) if "loss" in r]
    assert resumed[-4:] == [5, 6, 7, 8]


@pytest.mark.slow
def test_a_slow_rank_is_named_in_the_metrics_and_on_the_console(data, tmp_path):
    run = tmp_path / "run"
    args = train_args(data, run, "--run.steps=4", "--run.log_interval=2",
                      "--data.valid_samples=0")
    done, _, _ = _launch("slow", "1.0", args, tmp_path / "slow.log")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [r for r in metrics(run) if "slowest_rank" in r]
    assert [r["step"] for r in rows] == [2, 4]  # step 2 alone: the first is not timed
    for row in rows:
        assert row["slowest_rank"] == 1 and row["slowest_ratio"] > 1.5, row
        assert row["step_time_max"] >= 1.0 > row["step_time_median"], row
    warnings = [x for x in done.stderr.splitlines() if "is a straggler" in x]
    assert len(warnings) == 2 and "rank 1 is a straggler" in warnings[0], done.stderr[-3000:]
    assert "run.straggler_ratio 1.5" in warnings[0]


@pytest.mark.slow
def test_a_healthy_run_logs_the_ratio_and_warns_of_nothing(data, tmp_path):
    run = tmp_path / "run"
    # 4 micro-batches a step per rank, averaged over 4 steps: noise far below the threshold
    done = cli(*train_args(data, run, "--run.steps=8", "--run.log_interval=4",
                           "--data.global_batch_size=32", "--data.valid_samples=0"), nproc=2)
    rows = [r for r in metrics(run) if "slowest_rank" in r]
    assert [r["step"] for r in rows] == [4, 8]
    for row in rows:
        assert row["slowest_rank"] in (0, 1) and row["step_time_max"] > 0, row
        assert 1.0 <= row["slowest_ratio"] <= 1.5, row
    assert "straggler" not in done.stderr, done.stderr[-3000:]
