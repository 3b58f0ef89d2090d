"""megatron's checkpoint writer reports through a file (runtime.write_results): a save starts
no Manager process, and a report reaches the saving process from a forked writer however large
it is."""

import errno
import multiprocessing
import os
import queue

import psutil
import pytest
import torch

from model.builder import build_model
from model.config import ParallelConfig
from runtime import weights
from runtime.write_results import FileQueue
from tests.helpers import tiny_model


def test_reports_come_back_in_order_and_a_cut_short_one_is_not_read(monkeypatch):
    results = FileQueue()
    results.put({0: ["written"]})
    results.put(RuntimeError("a worker failed"))
    assert results.get_nowait() == {0: ["written"]}
    assert str(results.get_nowait()) == "a worker failed"
    with pytest.raises(queue.Empty):
        results.get_nowait()
    write = os.write

    def half_then_full_disk(fd, data):
        write(fd, bytes(data[:len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as patched:
        patched.setattr(os, "write", half_then_full_disk)
        with pytest.raises(OSError):
            results.put({1: ["cut short"]})
    with pytest.raises(queue.Empty):  # megatron then fails the save
        results.get_nowait()


@pytest.mark.slow  # forks a writer
def test_a_forked_writer_reports_more_than_a_pipe_holds_and_exits_before_it_is_read():
    """megatron reads a background write's report only once its writer has exited, so the
    report must not wait for a reader (a pipe holds 64 KiB)."""
    results = FileQueue()
    report = {0: ["x" * 1000] * 4000}  # 4 MB
    writer = multiprocessing.get_context("fork").Process(target=results.put, args=(report,))
    writer.start()
    writer.join(timeout=60)
    assert writer.exitcode == 0
    assert results.get_nowait() == report


def test_a_save_starts_no_process(single_rank, tmp_path):
    """megatron's own queue is a Manager: a spawned process per rank, started at the first
    save (tests/tiers.py fails this test if one starts)."""
    config = tiny_model("siamese")
    chunks = build_model(config, ParallelConfig(), seed=7)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    weights.save(chunks, tmp_path / "weights")
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
    loaded = build_model(config, ParallelConfig(), seed=8)
    weights.load(loaded, tmp_path / "weights")
    for a, b in zip(chunks[0].parameters(), loaded[0].parameters(), strict=True):
        assert torch.equal(a, b)
