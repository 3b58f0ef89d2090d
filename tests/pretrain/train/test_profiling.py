"""The training profiler (pretrain/train/profiling.py): a torch.profiler trace of the chosen
steps on the chosen ranks only, a memory snapshot when a step runs out of CUDA memory, and
the [profiling] fields refused in one line each.

The profiler's logic is driven here in-process with stand-in steps (a matrix product each);
one CLI run shows the loop wired to it, on two ranks of which only one traces."""

from __future__ import annotations

import json
import logging
import pickle
import warnings
from pathlib import Path

import pytest
import torch

from pretrain.config import ProfilingConfig, load_config
from pretrain.train import profiling
from runtime.errors import ConfigError
from tests.out_of_memory import MESSAGE
from tests.pretrain_fixtures import cli, run_logged, train_args


def run_steps(profiler: profiling.StepProfiler, numbers) -> None:
    for number in numbers:
        with profiler.step(number):
            torch.randn(16, 16) @ torch.randn(16, 16)
    profiler.close()


def step_ranges(trace: Path) -> list[str]:
    """The ``step N`` ranges a Chrome-trace file holds (it must be valid JSON)."""
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("ph") == "X" and e.get("dur", 0) > 0 for e in events)
    return sorted(e["name"] for e in events if str(e.get("name", "")).startswith("step "))


def make(tmp_path: Path, rank: int = 0, start: int = 0, cuda: bool = False, **fields):
    said: list[str] = []
    profiler = profiling.StepProfiler(ProfilingConfig(**fields), tmp_path, rank, start, cuda,
                                      said.append)
    return profiler, said


def test_traces_only_the_window_of_the_chosen_rank(tmp_path):
    profiler, said = make(tmp_path, first_step=2, steps=2)
    run_steps(profiler, range(1, 6))
    trace = tmp_path / "profile" / "rank0-step2-3.pt.trace.json"
    assert [p.name for p in (tmp_path / "profile").iterdir()] == [trace.name]
    assert step_ranges(trace) == ["step 2", "step 3"]  # step 1 was the warm-up
    assert said == [f"traced steps 2-3 on rank 0: {trace} (open it in "
                    "https://ui.perfetto.dev)"]

    other, said = make(tmp_path / "other", rank=1, first_step=2, steps=2)
    run_steps(other, range(1, 6))
    assert not (tmp_path / "other").exists()  # rank 1 was not asked: no profiler at all
    assert said == [f"traced steps 2-3 on rank 0: {trace.parent.parent / 'other'}"
                    "/profile/rank0-step2-3.pt.trace.json (open it in https://ui.perfetto.dev)"]


def test_first_step_one_traces_without_warm_up(tmp_path):
    """With no step before the window there is no warm-up, and no torch warning about it."""
    profiler, _ = make(tmp_path, first_step=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_steps(profiler, range(1, 3))
    assert step_ranges(tmp_path / "profile" / "rank0-step1.pt.trace.json") == ["step 1"]


def test_a_window_before_a_resumed_start_or_cut_short_writes_nothing(tmp_path):
    profiler, said = make(tmp_path, start=5, first_step=2, steps=2)
    run_steps(profiler, range(6, 8))
    assert said == ["profiling.first_step (2) lies before this start (after step 5): no trace"]

    profiler, said = make(tmp_path, first_step=2, steps=3)
    run_steps(profiler, range(1, 4))  # a stop after step 3
    assert said == ["the trace of steps 2-4 was cut short: not written"]
    assert not (tmp_path / "profile").exists()


@pytest.mark.parametrize("snapshot", [False, True])
def test_out_of_memory_on_the_cpu_passes_through_with_a_note(tmp_path, caplog, snapshot):
    profiler, said = make(tmp_path, first_step=2, steps=2, memory_snapshot=snapshot)
    error = torch.OutOfMemoryError("simulated")
    with pytest.raises(torch.OutOfMemoryError) as raised, caplog.at_level(logging.WARNING):
        with profiler.step(1):
            pass
        with profiler.step(2):
            raise error
    assert raised.value is error
    assert [r.getMessage() for r in caplog.records] == [
        "step 2 ran out of memory on rank 0; no memory snapshot: torch records allocator "
        "history only on a CUDA device"]
    note = "profiling.memory_snapshot: this run is on the CPU, where torch records no " \
        "allocator history; no snapshot will be written"
    assert said == [note] * snapshot + ["the trace of steps 2-3 was cut short: not written"]
    assert not (tmp_path / "profile").exists()


def test_out_of_memory_on_cuda_without_a_snapshot_says_how_to_get_one(tmp_path, caplog):
    profiler, _ = make(tmp_path, cuda=True)  # nothing asked: no CUDA call is made
    with pytest.raises(torch.OutOfMemoryError), caplog.at_level(logging.WARNING):
        with profiler.step(7):
            raise torch.OutOfMemoryError("simulated")
    assert caplog.records[0].getMessage() == (
        "step 7 ran out of CUDA memory on rank 0; for a snapshot of what filled it, run again "
        "with --profiling.memory_snapshot=true")


@pytest.mark.gpu
def test_out_of_memory_on_cuda_writes_a_memory_snapshot(tmp_path, caplog):
    profiler = profiling.build(ProfilingConfig(memory_snapshot=True), tmp_path, 0, 0,
                               lambda _: None)
    kept = torch.ones(1 << 20, device="cuda")  # an allocation the snapshot must show
    too_much = torch.cuda.get_device_properties(0).total_memory * 2
    with pytest.raises(torch.OutOfMemoryError), caplog.at_level(logging.WARNING):
        with profiler.step(3):
            torch.empty(too_much, dtype=torch.uint8, device="cuda")
    path = tmp_path / "profile" / "rank0-oom-step3.pickle"
    assert caplog.records[0].getMessage() == (
        f"step 3 ran out of CUDA memory on rank 0: memory snapshot in {path} (open it at "
        "https://pytorch.org/memory_viz)")
    snapshot = pickle.loads(path.read_bytes())
    assert sum(b["size"] for s in snapshot["segments"] for b in s["blocks"]
               if b["state"] == "active_allocated") >= kept.numel() * 4
    assert snapshot["device_traces"][0]  # the history was recorded
    assert not profiler.history  # and is off again


@pytest.mark.gpu
def test_a_trace_on_cuda_holds_the_kernels(tmp_path):
    profiler = profiling.build(ProfilingConfig(first_step=2), tmp_path, 0, 0, lambda _: None)
    for number in (1, 2, 3):
        with profiler.step(number):
            torch.randn(256, 256, device="cuda") @ torch.randn(256, 256, device="cuda")
            torch.cuda.synchronize()
    profiler.close()
    trace = tmp_path / "profile" / "rank0-step2.pt.trace.json"
    assert step_ranges(trace) == ["step 2"]
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)


@pytest.mark.parametrize("override, message", [
    ("--profiling.first_step=-1", "profiling.first_step (-1) must be >= 0 (0: no trace)"),
    ("--profiling.steps=0", "profiling.steps (0) must be >= 1"),
    ("--profiling.first_step=99", "profiling.first_step + profiling.steps - 1 (99 + 1 - 1 = "
     "99) must be <= run.steps (20): the traced steps must be steps of the run"),
    ("--profiling.ranks=-1", "profiling.ranks entry -1 must be >= 0 (a global rank)"),
    ("--profiling.ranks=[]", "profiling.ranks ([]) must name at least one rank to trace with "
     "profiling.first_step set"),
    ("--profiling.ranks=2", "profiling.ranks entry 2 must be < the world size (2)"),
])
def test_bad_fields_are_refused_in_one_line(tmp_path, override, message):
    overrides = [f"--run.dir={tmp_path / 'run'}", "--run.steps=20", "--profiling.first_step=3",
                 override]
    with pytest.raises(ConfigError) as raised:
        load_config(None, overrides, world_size=2)
    assert str(raised.value) == message


@pytest.mark.slow
def test_a_two_rank_run_traces_steps_two_and_three_on_rank_one_only(data, tmp_path):
    run = tmp_path / "run"
    done = cli(*train_args(data, run, "--run.steps=4", "--run.eval_interval=100",
                           "--profiling.first_step=2", "--profiling.steps=2",
                           "--profiling.ranks=1"), nproc=2)
    trace = run / "profile" / "rank1-step2-3.pt.trace.json"
    assert [p.name for p in (run / "profile").iterdir()] == [trace.name]
    assert step_ranges(trace) == ["step 2", "step 3"]
    assert f"traced steps 2-3 on rank 1: {trace} (open it in https://ui.perfetto.dev)" \
        in done.stderr + done.stdout


@pytest.mark.slow
def test_a_run_whose_step_runs_out_of_memory_ends_with_that_error(data, tmp_path):
    """On the CPU: the error goes on unchanged (torch's own, exit 1) after one note saying why
    there is no snapshot; the trace whose window it cut is not written."""
    run, log = tmp_path / "run", tmp_path / "run.log"
    status = run_logged("tests.out_of_memory", ["3", *train_args(
        data, run, "--run.steps=4", "--run.eval_interval=100", "--profiling.first_step=2",
        "--profiling.steps=2", "--profiling.memory_snapshot=true")], log)
    text = log.read_text()
    assert status == 1, text
    assert f"torch.OutOfMemoryError: {MESSAGE}" in text
    assert "step 3 ran out of memory on rank 0; no memory snapshot: torch records allocator " \
        "history only on a CUDA device" in text
    assert "profiling.memory_snapshot: this run is on the CPU" in text
    assert "the trace of steps 2-3 was cut short: not written" in text
    assert not (run / "profile").exists()


def test_eval_reads_a_run_config_that_traced_on_another_world(tmp_path):
    """A run traced on rank 4 of 8 is evaluated, or sampled, by fewer processes."""
    overrides = [f"--run.dir={tmp_path / 'run'}", "--run.steps=20", "--profiling.first_step=3",
                 "--profiling.ranks=4"]
    assert load_config(None, overrides, training=False, world_size=1).profiling.ranks == [4]
