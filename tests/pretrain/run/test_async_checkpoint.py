"""Checkpoints written in the background (run.async_save), through the real CLI: they hold what
a foreground save of the same step holds although training goes on while they are written,
they resume exactly, and neither a SIGKILL during the background write nor a write that fails
costs the previous checkpoint."""

import json
import logging
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from model.builder import build_model, wrap_ddp
from pretrain.config import Config, RunConfig
from pretrain.optim import build_optimizer
from pretrain.run import checkpoint
from pretrain.run.saver import Saver
from runtime.schedule import forward_backward
from tests.helpers import MBS, SEQ, batches, tiny_model
from tests.pretrain_fixtures import REPO, cli, env, run_logged, train_args, train_losses

STEPS, EVERY = 9, 3
# One rank with megatron's plain optimizer: its weights and Adam moments are whole tensors,
# which megatron's save planning hands to the writer uncopied (the distributed optimizer's
# views of its buffers it copies), so only the writer's own snapshot keeps them at their step.
PLAIN = "--parallel.distributed_optimizer=false"
COMMON = [f"--run.steps={STEPS}", f"--run.save_interval={EVERY}", "--run.keep_last=3",
          "--run.eval_interval=100", PLAIN]
BACKGROUND = "--run.async_save=true"
SAVED = [f"step_{s:08d}" for s in range(EVERY, STEPS + 1, EVERY)]


@pytest.fixture(scope="module")
def foreground(data, tmp_path_factory):
    """A run saving every 3 steps in the foreground."""
    run = tmp_path_factory.mktemp("foreground") / "run"
    cli(*train_args(data, run, *COMMON))
    return run


@pytest.fixture(scope="module")
def background(data, tmp_path_factory):
    """The same run, saving in the background."""
    run = tmp_path_factory.mktemp("background") / "run"
    cli(*train_args(data, run, *COMMON, BACKGROUND))
    return run


def contents(folder: Path) -> dict:
    """Everything a checkpoint holds: megatron's tensors and objects (read with torch's own
    converter, no process group), each rank's RNG file, and complete.json less its record of
    the run's config, which differs (run.dir, run.async_save)."""
    with tempfile.TemporaryDirectory() as scratch:
        dcp_to_torch_save(folder, Path(scratch) / "all.pt")
        held = torch.load(Path(scratch) / "all.pt", weights_only=False)
    for rng in sorted((folder / "rng").iterdir()):
        held[f"rng/{rng.name}"] = checkpoint.read_rng_state(rng)
    record = json.loads((folder / checkpoint.COMPLETE).read_text())
    for differs in ("config_sha256", "settings"):  # the run's config: its dir, async_save
        record.pop(differs, None)
    held["complete.json"] = record
    return held


def assert_same(a, b, where: str = "") -> None:
    """Equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, np.ndarray):  # numpy's RNG state
        assert isinstance(b, np.ndarray) and np.array_equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a, key=str) == sorted(b, key=str), where
        for key in a:
            assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def assert_same_checkpoints(run_a: Path, run_b: Path, names: list[str]) -> None:
    for name in names:
        a = contents(run_a / "checkpoints" / name)
        assert any("exp_avg_sq" in key for key in a)  # the optimizer state is in it
        assert_same(a, contents(run_b / "checkpoints" / name), name)


def test_background_checkpoints_equal_foreground_ones(foreground, background):
    """Each checkpoint is complete when the run ends and holds the state of its step, though
    the next steps updated the weights and the Adam moments in place while it was written."""
    assert sorted(p.name for p in (background / "checkpoints").iterdir()) == ["latest", *SAVED]
    assert (background / "checkpoints" / "latest").read_text() == SAVED[-1]
    assert train_losses(background) == train_losses(foreground)
    assert_same_checkpoints(foreground, background, SAVED)


def test_a_resume_from_a_background_checkpoint_repeats_every_loss(data, foreground, background,
                                                                   tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(background / "checkpoints" / SAVED[0], run / "checkpoints" / SAVED[0])
    cli(*train_args(data, run, *COMMON, BACKGROUND))
    resumed, reference = train_losses(run), train_losses(foreground)
    assert sorted(resumed) == list(range(EVERY + 1, STEPS + 1))
    assert resumed == {step: reference[step] for step in resumed}  # exact, step by step
    assert_same_checkpoints(foreground, run, SAVED[1:])


def test_sigkill_during_a_background_write_keeps_the_previous_checkpoint(data, foreground,
                                                                         tmp_path):
    """The training process is killed while the writer of step 6 is in flight: the files it
    wrote stay in .step_6.tmp, never a checkpoint; the resume repeats every loss."""
    run = tmp_path / "run"
    args = train_args(data, run, *COMMON, BACKGROUND)
    # the writer outlives a SIGKILLed trainer until its write ends: run_logged reaps it
    code = run_logged("tests.kill_in_save", ["--background", "6", *args],
                      tmp_path / "killed.log", timeout=240)
    assert code == -signal.SIGKILL, (tmp_path / "killed.log").read_text()[-2000:]
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text() == SAVED[0]
    assert checkpoint.resolve(ckpts) == ckpts / SAVED[0]
    partial = ckpts / ".step_00000006.tmp"
    assert list(partial.glob("*.distcp"))  # the writer wrote the tensors...
    assert not (partial / ".metadata").exists()  # ...but no rank finalised them
    assert not (partial / checkpoint.COMPLETE).exists()
    cli(*args)
    assert train_losses(run) == train_losses(foreground)
    assert not partial.exists()
    assert sorted(p.name for p in ckpts.glob("step_*")) == SAVED


def _limit_file_size(size: int):
    def apply() -> None:  # in the child: writes past `size` bytes fail with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    return apply


@pytest.mark.parametrize("steps", [6, 9], ids=["found-at-the-end", "found-during-training"])
def test_a_failed_background_write_stops_the_run_and_keeps_the_previous_checkpoint(
        data, background, tmp_path, steps):
    """Files capped at 64 KB (the tensor shard is larger): the background write of step 6
    fails in the forked writer. The run stops with the foreground save's one error line, found
    when the run ends (6 steps) or while it trains on (9 steps: by a step's poll, or at the
    latest by the save of step 9, which waits for it)."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(background / "checkpoints" / SAVED[0], run / "checkpoints" / SAVED[0])
    args = train_args(data, run, f"--run.steps={steps}", f"--run.save_interval={EVERY}",
                      "--run.eval_interval=100", "--optim.override_schedule=true", PLAIN,
                      BACKGROUND, f"--data.cache_dir={tmp_path / 'cache'}")
    done = subprocess.run([sys.executable, "-m", "pretrain", *args], cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=300,
                          preexec_fn=_limit_file_size(64 * 1024))
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr[-2000:]
    assert "saving checkpoint step 6" in errors[0] and "failed" in errors[0], errors[0]
    assert f"the latest checkpoint is {run / 'checkpoints' / SAVED[0]}" in errors[0], errors[0]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [SAVED[0]]


def test_two_gloo_ranks_with_the_distributed_optimizer(data, tmp_path):
    """Data parallel over 2 gloo ranks, each writing its shard of the distributed optimizer's
    state in its own background writer while training goes on. A foreground run resumed from
    the background checkpoint of step 3 repeats the losses of steps 4-7 and saves at steps 6
    and 7 (the run's end) the checkpoints the background run wrote there, tensor for tensor:
    the background writes hold the foreground's contents (steps 6 and 7 directly, step 3
    through everything resumed from it), in two runs rather than three."""
    layout = ["--parallel.distributed_optimizer=true", "--run.steps=7", "--run.keep_last=3",
              f"--run.save_interval={EVERY}", "--run.eval_interval=100"]
    background = tmp_path / "background"
    cli(*train_args(data, background, *layout, BACKGROUND), nproc=2)
    first, second, last = SAVED[0], SAVED[1], "step_00000007"
    rngs = sorted(p.name for p in (background / "checkpoints" / first / "rng").iterdir())
    assert rngs == ["rank0.pt", "rank1.pt"]
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(background / "checkpoints" / first, resumed / "checkpoints" / first)
    cli(*train_args(data, resumed, *layout), nproc=2)
    reference = train_losses(background)
    assert train_losses(resumed) == {step: reference[step] for step in (4, 5, 6, 7)}
    assert_same_checkpoints(background, resumed, [second, last])


@pytest.mark.slow  # the writer is a forked process
def test_an_exception_waits_for_the_write_and_says_the_checkpoint_is_not_complete(
        single_rank, tmp_path, caplog):
    """In process: a save in flight when the run ends in an exception (the ranks may not all
    be there to complete it) is waited for and reported, and stays a .tmp folder; the stop
    message of a run the ranks agree to end (latest_text) completes it first."""
    config = Config(model=tiny_model("siamese"), run=RunConfig(steps=100))
    chunks = wrap_ddp(build_model(config.model, config.parallel, seed=7), config.parallel)
    optimizer, scheduler = build_optimizer(config, chunks, torch.float32)
    forward_backward(chunks, batches(2), 2, SEQ, MBS)
    optimizer.step()  # an optimizer with state to save
    saver = Saver(tmp_path, keep_last=2, background=True)
    saver.save(1, chunks, optimizer, scheduler, record={})
    writers = [call.async_caller.process for call in saver.calls.async_calls]
    with caplog.at_level(logging.WARNING, logger="pretrain"):
        saver.close()
    assert writers and all(w.exitcode == 0 for w in writers)  # joined, and it wrote
    assert "the checkpoint of step 1 was not completed" in caplog.text
    assert list((tmp_path / ".step_00000001.tmp").glob("*.distcp"))
    assert checkpoint.resolve(tmp_path) is None
    saver.save(2, chunks, optimizer, scheduler, record={})
    assert saver.latest_text() == f"the latest checkpoint is {tmp_path / 'step_00000002'}"
    # The abandoned write's report is gone: megatron's writers report into one queue per
    # process, which the next save reads, a foreground one too; another model's save would
    # take it for its own and miss its tensors.
    saver = Saver(tmp_path / "again", keep_last=2, background=True)
    saver.save(1, chunks, optimizer, scheduler, record={})
    saver.close()
    other = Config(model=tiny_model("pre"), run=RunConfig(steps=100))
    other_chunks = wrap_ddp(build_model(other.model, other.parallel, seed=7), other.parallel)
    other_optimizer, other_scheduler = build_optimizer(other, other_chunks, torch.float32)
    forward_backward(other_chunks, batches(2), 2, SEQ, MBS)
    other_optimizer.step()
    saved = checkpoint.save(tmp_path / "other", 1, other_chunks, other_optimizer,
                            other_scheduler, keep_last=1, record={})
    checkpoint.load(saved, checkpoint.read_record(saved), other_chunks, other_optimizer,
                    other_scheduler)
