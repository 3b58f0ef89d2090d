"""The trainer's read-ahead of the next step's micro-batches: the same batches in the same
order as reading in the step, read in the background thread, re-read when the step's
position moved, and a failed read raised in the step that needs it."""

from __future__ import annotations

import threading

import pytest

from pretrain.data.prefetch import Prefetcher


class Reader:
    """read(start): a step's 'micro-batches', with who read what on which thread."""

    def __init__(self, failing: frozenset[int] = frozenset(), gate: threading.Event = None):
        self.calls: list[tuple[int, str]] = []
        self.failing, self.gate = failing, gate

    def __call__(self, start: int) -> list[dict]:
        if self.gate is not None:
            self.gate.wait(5)
        self.calls.append((start, threading.current_thread().name))
        if start in self.failing:
            raise OSError(f"cannot read sample {start}")
        return [{"first": start, "micro": k} for k in range(2)]


def test_steps_read_ahead_give_the_batches_of_reading_in_the_step():
    reader = Reader()
    prefetch = Prefetcher(reader)
    starts = [0, 8, 16, 24]
    got = []
    for i, start in enumerate(starts):
        got.append(prefetch.take(start))
        if i + 1 < len(starts):
            prefetch.ahead(starts[i + 1])
    prefetch.close()
    assert got == [Reader()(s) for s in starts]
    main = threading.current_thread().name
    assert reader.calls[0] == (0, main)  # the first step has nothing read ahead
    assert [s for s, _ in reader.calls] == starts  # every step read once
    assert all(name.startswith("prefetch") for _, name in reader.calls[1:])


def test_a_step_whose_position_moved_reads_its_own_batches():
    reader = Reader()
    prefetch = Prefetcher(reader)
    prefetch.ahead(8)  # then a rollback moves the step to sample 40
    assert prefetch.take(40) == Reader()(40)
    assert reader.calls[-1] == (40, threading.current_thread().name)
    assert prefetch.take(48) == Reader()(48)  # nothing stale is left behind
    prefetch.close()


def test_the_read_overlaps_the_caller():
    gate = threading.Event()
    reader = Reader(gate=gate)
    prefetch = Prefetcher(reader)
    prefetch.ahead(8)
    assert reader.calls == []  # the caller went on while the read waits (on the disk)
    gate.set()
    assert prefetch.take(8)[0]["first"] == 8
    prefetch.close()


def test_a_failed_read_ahead_fails_the_step_that_needs_it_only():
    prefetch = Prefetcher(Reader(failing=frozenset({8})))
    prefetch.ahead(8)
    with pytest.raises(OSError, match="cannot read sample 8"):
        prefetch.take(8)
    prefetch.ahead(8)
    assert prefetch.take(16)[0]["first"] == 16  # a read nobody needs fails nobody
    prefetch.close()
