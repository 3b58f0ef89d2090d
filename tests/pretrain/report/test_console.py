"""What a user sees: a quiet console with the run's facts and an ETA, forgiving overrides,
the natural mistakes answered with their fix, and a run folder a failed start cannot spoil."""

from __future__ import annotations

import json
import re

import pytest

from pretrain.config import load_config
from pretrain.report.progress import clock
from runtime.errors import ConfigError
from tests.pretrain_fixtures import cli, train_args

WARNING_LINE = re.compile(r"Warning|warnings\.warn|\[megatron\]")


def test_train_console_is_quiet_and_shows_the_run_then_progress(data, tmp_path):
    run = tmp_path / "run"
    done = cli(*train_args(data, run, "--run.steps=4", "--run.eval_interval=2"))
    console = done.stderr.splitlines()
    assert not [line for line in console if WARNING_LINE.search(line)], done.stderr
    start = console[:next(i for i, line in enumerate(console) if " step 1/" in line)]
    assert len(start) <= 8, start  # the plan, not a wall of start-up noise
    first = "\n".join(start)
    for fact in ("training siamese:", "parameters (2 layers x 64, 4 heads), float32 on cpu",
                 "layout: world 1 = tp 1 x pp 1 x dp 1", "tokens per step x 4 steps",
                 "the run reads 0.00 epochs", f"run folder: {run}; starting at step 0"):
        assert fact in first, (fact, first)
    steps = [line for line in console if line.startswith("[pretrain] step ")]
    assert len(steps) == 4
    assert re.search(r"step 2/4 \(50%\) loss \d\.\d{4} lr .* tok/s \| elapsed \d+s, ETA \d+s",
                     steps[1]), steps[1]
    assert [line for line in console if "validation at step" in line][-1].startswith(
        "[pretrain] validation at step 4: loss ")
    assert json.loads(done.stdout.strip().splitlines()[-1])["val_loss"] > 0
    verbose = cli("eval", "--config", str(run / "config.toml"), "--checkpoint",
                  str(run / "checkpoints"), "--verbose")
    assert re.search(r"UserWarning: Transformer Engine and Apex are not installed",
                     verbose.stderr), verbose.stderr[-2000:]


def test_clock():
    assert [clock(s) for s in (0.4, 45, 65, 3600 + 180, 7 * 3600)] == [
        "0s", "45s", "1m05s", "1h03m", "7h00m"]


@pytest.mark.parametrize("overrides, prefixes, weights", [
    (["--data.prefixes=data/a,data/b"], ["data/a", "data/b"], []),
    (["--data.prefixes=data/a", "--data.prefixes=data/b"], ["data/a", "data/b"], []),
    (["--data.prefixes=data/a"], ["data/a"], []),
    (["--data.prefixes=[data/a, data/b]"], ["data/a", "data/b"], []),
    (['--data.prefixes=["data/a", "data/b"]', "--data.weights=0.3,0.7"],
     ["data/a", "data/b"], [0.3, 0.7]),
    (['--data.prefixes=["0.3", "data/a", "0.7", "data/b"]'], ["data/a", "data/b"], [0.3, 0.7]),
    (["--data.prefixes=0.3,data/a,0.7,data/b"], ["data/a", "data/b"], [0.3, 0.7]),
], ids=["commas", "repeated", "one-string", "brackets", "toml-and-weights",
        "megatron-weighted", "megatron-weighted-commas"])
def test_list_overrides_are_forgiving(overrides, prefixes, weights):
    data = load_config(None, overrides).data
    assert (data.prefixes, data.weights) == (prefixes, weights)


def test_a_repeated_scalar_key_keeps_the_last_value():
    assert load_config(None, ["--optim.lr=1e-3", "--optim.lr=2e-3"]).optim.lr == 2e-3


@pytest.mark.parametrize("overrides, fragment", [
    (["--optim.lrr=1e-3"], "unknown config key optim.lrr (did you mean optim.lr?)"),
    (["--optm.lr=1e-3"], "unknown config section [optm] (did you mean optim?)"),
    (['--data.prefixes=["corpus.bin"]'],
     "data.prefixes entry 'corpus.bin' names a file; give the dataset prefix without "
     ".bin/.idx ('corpus')"),
])
def test_natural_config_mistakes_name_the_fix(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert fragment in str(err.value)


def test_eval_checks_what_evaluation_needs_not_the_schedule():
    with pytest.raises(ConfigError, match="optim.warmup_steps"):
        load_config(None, ["--run.steps=5", "--optim.warmup_steps=10"])
    config = load_config(None, ["--run.steps=5", "--optim.warmup_steps=10"], training=False)
    assert config.run.steps == 5


@pytest.mark.parametrize("args, fragment", [
    (["train"], "train needs --config FILE (e.g. --config configs/demo-cpu.toml), or "
                "--run.dir=RUN of an existing run"),
    (["eval", "--checkpoint", "/nonexistent/ckpt"], "eval needs --config FILE"),
])
@pytest.mark.slow
def test_a_missing_config_says_how_to_give_one(args, fragment):
    done = cli(*args, check=False)
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and fragment in last, last


@pytest.mark.slow
def test_help_teaches_the_override_syntax():
    done = cli("train", "--help")
    assert "--section.key=value" in done.stdout
    assert "--data.prefixes=data/a,data/b" in done.stdout


def test_a_failed_first_start_leaves_the_run_folder_usable(data, tmp_path):
    """A first start that aborts before any checkpoint (an absurd LR: NaN, exit 3), then a good
    start in the same folder: config.toml is the good run's, no config-resume file exists, and
    `eval --config RUN/config.toml` works, also with a run length its warm-up would refuse;
    without --config, eval finds the run folder's config from the checkpoint path."""
    run = tmp_path / "run"
    bad = cli(*train_args(data, run, "--run.steps=6", "--optim.lr=1e30", "--optim.min_lr=0",
                          "--optim.warmup_steps=1", "--guard.max_skipped=2",
                          "--data.valid_samples=0"), check=False)
    assert bad.returncode == 3, bad.stderr[-2000:]
    assert "lr = 1e+30" in (run / "config.toml").read_text()
    cli(*train_args(data, run, "--run.steps=4"))
    assert "lr = 0.003" in (run / "config.toml").read_text()
    assert not list(run.glob("config-resume-*.toml"))
    done = cli("eval", "--config", str(run / "config.toml"), "--checkpoint",
               str(run / "checkpoints"), "--run.steps=1")
    assert json.loads(done.stdout.strip().splitlines()[-1])["checkpoint"].endswith(
        "step_00000004")
    found = cli("eval", "--checkpoint", str(run / "checkpoints" / "step_00000004"))
    assert json.loads(found.stdout.strip().splitlines()[-1])["val_loss"] > 0


_LIVE_LINE = """
import time
from pretrain.report.progress import Progress
progress = Progress(0, 4)
progress.begin()
for step in range(1, 5):
    time.sleep(0.12)
    progress.step(step, {"loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1000.0})
progress.message("validation at step 4: loss 2.4000, perplexity 11.0")
progress.close()
"""


def test_on_a_terminal_progress_is_one_live_line():
    """Under a real pseudo-terminal (150 columns) the bar redraws in place (carriage returns,
    no new line per step) with the step's numbers, and a message prints above it."""
    import fcntl
    import os
    import pty
    import struct
    import sys
    import termios

    from tests.pretrain_fixtures import REPO, env

    pid, fd = pty.fork()
    if pid == 0:  # the child: a terminal of 150 columns, then the progress loop
        fcntl.ioctl(1, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 150, 0, 0))
        os.chdir(REPO)
        os.execve(sys.executable, [sys.executable, "-c", _LIVE_LINE], env())
    out = b""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.waitpid(pid, 0)
    text = out.decode(errors="replace")
    assert "[pretrain] validation at step 4: loss 2.4000" in text, text
    bar = [part for part in text.split("\r") if "4/4" in part]
    assert bar and "loss 2.5000 lr 1.00e-03 grad_norm 0.500 1,000 tok/s" in bar[-1], text
    assert text.count("\n") <= 3, text  # redrawn in place, not one line per step


def test_a_library_line_with_its_own_handler_shows_once(capfd):
    """datasets and huggingface_hub print through their own stderr handler and also pass the
    record to the root: the console shows it once, and our own lines still show."""
    import logging
    import sys

    from pretrain.report import console

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    library = logging.getLogger("somelibrary")
    own = logging.StreamHandler(sys.stderr)
    library.addHandler(own)
    try:
        console.setup()
        capfd.readouterr()
        logging.getLogger("somelibrary.part").warning("a library line")
        logging.getLogger("pretrain").warning("a line of ours")
        err = capfd.readouterr().err
    finally:
        library.removeHandler(own)
        root.handlers[:] = handlers
        root.setLevel(level)
    assert err.count("a library line") == 1, err
    assert "[pretrain] a line of ours" in err, err


def test_the_eta_leaves_out_the_first_step(monkeypatch):
    """A first step of 100 s (a compiled run's compilation) then steps of 1 s: after step 3 of
    10 the ETA is the 7 steps left at 1 s, not at the mean of all three (34 s); after the
    first step alone there is none. A resumed run counts from the step it started at."""
    from pretrain.report import progress as module

    now = [0.0]
    monkeypatch.setattr(module.time, "perf_counter", lambda: now[0])
    for start in (0, 5):
        progress = module.Progress(start, start + 10, enabled=False)
        progress.begin()
        ticks = [100.0, 1.0, 1.0]
        for step, seconds in enumerate(ticks, start + 1):
            now[0] += seconds
            progress.step(step, None)
            elapsed, left = progress.timing(step)
            if step == start + 1:
                assert (elapsed, left) == (100.0, None)
        assert (elapsed, left) == (102.0, 7.0)
