"""Where megatron-core's checkpoint writer reports a save: a file of the saving process.

megatron-core's filesystem writer (``FileSystemWriterAsync``, behind every torch_dist save, in
the foreground too) hands each write's results, or its error, back through a queue that its
``get_write_results_queue`` makes at a process's first save: a spawn-context multiprocessing
Manager, i.e. a second Python process per rank, and multiprocessing's resource tracker as a
third. What that cost, measured on a 2-core CPU with a tiny model: the Manager imports torch
when the first report reaches it, so a run's first save took 1.8-3.3 s instead of 0.05-0.13 s;
it then held 268 MiB (RSS; the tracker 13 MiB) to the end of the run. A Manager ignores SIGINT,
so an exit without the interpreter's exit handlers (``os._exit``: a second Ctrl-C, the hang
watchdog) or a SIGKILL left it running with parent 1 until killed by hand. And SIGTERM to the
whole process group (slurm, ``kill -TERM -PGID``) killed it while the training process went on
to its stop checkpoint, which then failed (``Broken pipe``), exit 2.

:func:`reported_in_a_file` gives the saves inside it a :class:`FileQueue` instead: an unlinked
temporary file the writer appends its pickled report to and the saving process reads back. It
works within the process (a foreground save) and from megatron's forked writer (a background
save: the child inherits the open file), starts no process, and leaves nothing behind on any
exit: the kernel frees an unlinked file with its last descriptor. A pipe would not do: a writer
whose report outgrew the pipe's buffer would wait for a reader, and megatron reads only once
the writer has exited. Each save gets its own queue, so the report of a write that was given up
on can never be read as the next save's.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pickle
import queue
import struct
import tempfile
from collections.abc import Iterator

from megatron.core.dist_checkpointing.strategies import filesystem_async

_LENGTH = struct.Struct("<Q")


class FileQueue:
    """The two calls megatron makes of its results queue, ``put`` (the writer) and
    ``get_nowait`` (the saving process, once the writer has ended), on an unlinked file."""

    def __init__(self) -> None:
        self._file = tempfile.TemporaryFile()
        fd = self._file.fileno()
        # Appends go to the end whoever writes: the saving process and its forked writers
        # share one file offset, which the reads (pread) leave alone.
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
        self._read = 0

    def put(self, item: object) -> None:
        data = pickle.dumps(item)
        record = memoryview(_LENGTH.pack(len(data)) + data)
        while record:
            record = record[os.write(self._file.fileno(), record):]

    def get_nowait(self) -> object:
        """The oldest report not read yet; ``queue.Empty`` when there is none, or when its
        writer died in the middle of it (megatron then fails the save)."""
        fd = self._file.fileno()
        head = os.pread(fd, _LENGTH.size, self._read)
        if len(head) < _LENGTH.size:
            raise queue.Empty
        (size,) = _LENGTH.unpack(head)
        data = os.pread(fd, size, self._read + _LENGTH.size)
        if len(data) < size:
            raise queue.Empty
        self._read += _LENGTH.size + size
        return pickle.loads(data)  # written by this process or its own forked writer


@contextlib.contextmanager
def reported_in_a_file() -> Iterator[FileQueue]:
    """The megatron saves inside report to a new :class:`FileQueue`, never to a Manager
    process. A writer keeps the queue it was planned with, so a background write goes on
    reporting to it after the scope ends."""
    previous = filesystem_async._results_queue
    filesystem_async._results_queue = results = FileQueue()
    try:
        yield results
    finally:
        filesystem_async._results_queue = previous
