"""The next step's micro-batches, read in a background thread while this step computes.

Why: a rank reads its micro-batches from memory-mapped files, and a read that misses the page
cache waits on the disk (on the development machine's virtual disk, a 10B-token blend gave
122 sequences/s from a cold cache, docs/data.md). Read in the step, that wait is on the
training path; read one step ahead, it overlaps the step's compute. numpy copies out of the
memory map without holding the GIL, and torch's kernels release it, so one thread is enough.

The read is keyed by the step's first sample: a step whose position changed after the read
was started (a rollback past bad batches) reads its own batches then, so the samples and their
order are exactly those of a run without prefetching. A failed background read raises in the
step that asks for its batches, as a synchronous read would.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor


class Prefetcher:
    def __init__(self, read: Callable[[int], list[dict]]):
        """``read(start)``: the micro-batches of the step whose first sample is ``start``."""
        self._read = read
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="prefetch")
        self._pending: tuple[int, Future] | None = None

    def take(self, start: int) -> list[dict]:
        """The micro-batches of the step starting at sample ``start``: the ones read ahead
        when they are that step's, else read now."""
        pending, self._pending = self._pending, None
        if pending is not None:
            key, future = pending
            if key == start:
                return future.result()
            future.cancel()
            _quietly(future)  # not this step's: its error (if any) is not this step's either
        return self._read(start)

    def ahead(self, start: int) -> None:
        """Start reading the step starting at sample ``start``."""
        if self._pending is not None:
            _quietly(self._pending[1])
        self._pending = (start, self._pool.submit(self._read, start))

    def close(self) -> None:
        self._pending = None
        self._pool.shutdown(wait=True, cancel_futures=True)


def _quietly(future: Future) -> None:
    """Wait for a read nobody needs (so two never run at once) and drop its outcome."""
    if not future.cancelled():
        try:
            future.result()
        except Exception:  # noqa: BLE001 - an unneeded read's failure is nobody's error
            pass
