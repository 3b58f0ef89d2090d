"""Text -> Megatron indexed dataset (``.bin``/``.idx``), written by megatron-core's own builder.

Every document is followed by the tokenizer's EOD token and is one megatron document. The token
dtype is the one megatron picks for the vocabulary (``DType.optimal_dtype``: uint16 below 65,500
ids, else int32), so files made here and by Megatron-LM's preprocessing are interchangeable in
both directions. Output goes to temporary names and is renamed into place at the end; existing
outputs are never overwritten, so an interrupted or mistaken run loses nothing. Beside them goes
the dataset's record (``PREFIX.record.json``, :mod:`pretrain.data.record`): the tokenizer that
made it and its token-id range, so a start checks both without reading the corpus. Empty
documents (blank JSON lines, empty texts) are skipped (each would be a lone EOD token) and
counted, in the summary and the record (``empty_skipped``), so none is lost unnoticed.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import time
import traceback
from collections import deque
from collections.abc import Iterable, Iterator
from itertools import islice
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
from tqdm import tqdm

from pretrain.data import record, round_trip
from pretrain.data.documents import (
    BY_DEFAULT,
    Reading,
    Skipped,
    Span,
    check_input,
    iter_documents,
    plain_text_counts,
)
from pretrain.data.tokenizer import Tokenizer, open_tokenizer
from pretrain.paths import require_creatable
from runtime.errors import ConfigError, DataError

log = logging.getLogger("pretrain")

# Documents per unit of work: big enough that a worker's round trip is cheap, small enough that
# the few in flight (one per worker) bound memory; the corpus is never held whole.
CHUNK_DOCUMENTS = 256
# Without a terminal (a log file) a progress bar is one long line of carriage returns: a plain
# line at most this often instead.
LOG_SECONDS = 30.0

# How long the parent waits for a killed worker to be reaped before it goes on without.
STOP_SECONDS = 10.0


def _encode_chunk(tokenizer: Tokenizer, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(ids, lengths): every document's ids followed by EOD, concatenated. One flat buffer is
    what a worker sends back; pickling it costs a fraction of a list (or array) per document."""
    arrays = [np.array(tokenizer.encode(text) + [tokenizer.eod], dtype=np.int32)
              for text in texts]
    return np.concatenate(arrays), np.array([len(a) for a in arrays], dtype=np.int64)


def _work(conn: Connection, parent_end: Connection, model_file: str) -> None:
    """A worker: chunks in, encoded chunks (or the exception) out, until the parent closes its
    end. Ctrl-C is the parent's: a terminal sends SIGINT to the whole process group, and a
    worker interrupted mid-task would print its own traceback. The worker is born with SIGINT
    blocked (:func:`_sigint_blocked`), so a press during its start is discarded here, not
    raised. Its copy of the parent's end is closed so that the parent's exit, however abrupt,
    reads here as the end of the input."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    parent_end.close()
    tokenizer = None
    while True:
        try:
            texts = conn.recv()
        except EOFError:
            return
        try:
            if tokenizer is None:
                tokenizer = open_tokenizer(model_file)
            reply = _encode_chunk(tokenizer, texts)
        except Exception as err:  # raised again in the parent, with this traceback
            err.add_note("in a prepare-data worker:\n" + traceback.format_exc().rstrip())
            reply = err if _picklable(err) else RuntimeError(
                f"{type(err).__name__}: {err}\n" + "\n".join(err.__notes__))
        try:
            conn.send(reply)
        except OSError:  # the parent is gone
            return


def _picklable(value) -> bool:
    try:
        pickle.dumps(value)
    except Exception:
        return False
    return True


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """SIGINT held back while workers are started: a process inherits the signal mask of the
    thread that starts it (across fork and exec alike), so a Ctrl-C that lands before a worker
    has set itself to ignore SIGINT stays pending there until it has, and is then dropped.
    The parent gets its own press when the mask is restored."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class _Worker(NamedTuple):
    process: BaseProcess
    conn: Connection


def _send(worker: _Worker, chunk: list[str]) -> None:
    try:
        worker.conn.send(chunk)
    except OSError:
        raise _ended(worker) from None


def _receive(worker: _Worker) -> tuple[np.ndarray, np.ndarray]:
    try:
        reply = worker.conn.recv()
    except (EOFError, OSError):
        raise _ended(worker) from None
    if isinstance(reply, BaseException):
        raise reply
    return reply


def _ended(worker: _Worker) -> RuntimeError:
    """A worker gone without a word (killed): said, where a shared pool would wait forever
    for the result it took along."""
    worker.process.join(STOP_SECONDS)
    return RuntimeError(
        f"prepare-data worker {worker.process.pid} ended with a chunk in hand (exit code "
        f"{worker.process.exitcode}; -9 is SIGKILL, often the out-of-memory killer: fewer "
        "--workers use less memory)")


def _stop(workers: list[_Worker]) -> None:
    """SIGKILL, then a bounded wait for each worker; safe at any moment, mid-message included.
    A worker holds nothing worth finishing (it writes no file) and shares no lock or queue
    with the parent or the other workers: each has its own pipe, and a message cut off in one
    is closed unread. (``multiprocessing.Pool.terminate`` stops reading results before it
    stops the workers: one then sending a result bigger than a pipe holds blocks with the
    result queue's lock held, which terminate itself then waits for, forever.)"""
    for worker in workers:
        if worker.process.pid is not None:
            worker.process.kill()
    deadline = time.monotonic() + STOP_SECONDS
    for worker in workers:
        if worker.process.pid is not None:
            worker.process.join(max(0.0, deadline - time.monotonic()))
        worker.conn.close()


def _chunks(inputs: list[str | Span], reading: Reading,
            skipped: Skipped) -> Iterator[list[str]]:
    documents = (doc for path in inputs for doc in iter_documents(path, reading, skipped))
    while chunk := list(islice(documents, CHUNK_DOCUMENTS)):
        yield chunk


def _encoded(inputs: list[str | Span], tokenizer: Tokenizer, workers: int, reading: Reading,
             skipped: Skipped) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Encoded chunks in input order. Each worker has its own pipe and at most one chunk in
    hand; the parent reads the oldest result, hands that worker the next chunk (read from the
    input while the workers encoded), then gives the result to the writer, so the workers
    encode while it writes. One chunk per worker is what keeps the pipes from deadlocking: the
    parent only ever sends to a worker that is waiting for input. Closing the generator (any
    exit, Ctrl-C included) kills the workers (:func:`_stop`)."""
    chunks = _chunks(inputs, reading, skipped)  # read here: ``skipped`` counts in this process
    if workers == 1:
        yield from (_encode_chunk(tokenizer, chunk) for chunk in chunks)
        return
    context = multiprocessing.get_context()
    started: list[_Worker] = []
    try:
        with _sigint_blocked():
            for number in range(workers):
                here, there = context.Pipe()
                process = context.Process(target=_work, args=(there, here, tokenizer.path),
                                          name=f"prepare-data-worker-{number}", daemon=True)
                started.append(_Worker(process, here))
                process.start()
                there.close()
        idle, busy = deque(started), deque()  # busy: the workers with a chunk, oldest first
        for chunk in chunks:
            result = None
            if idle:
                worker = idle.popleft()
            else:
                worker = busy.popleft()
                result = _receive(worker)
            _send(worker, chunk)
            busy.append(worker)
            if result is not None:
                yield result
        while busy:
            yield _receive(busy.popleft())
    finally:
        _stop(started)


class Written(NamedTuple):
    documents: int
    tokens: int
    ids: tuple[int, int]  # the lowest and highest token id, for the dataset's record


def _write(builder: IndexedDatasetBuilder, chunks: Iterable) -> Written:
    """One item and one document per input document, as Megatron-LM's preprocessing writes
    them without sentence splitting."""
    documents = tokens = 0
    lowest, highest = np.iinfo(np.int64).max, -1
    terminal = sys.stderr.isatty()
    last_line = time.monotonic()
    with tqdm(desc="tokenising", unit="doc", file=sys.stderr, disable=not terminal) as bar:
        for ids, lengths in chunks:
            for document in np.split(ids, np.cumsum(lengths)[:-1]):
                builder.add_item(torch.from_numpy(document))
                builder.end_document()
            documents += len(lengths)
            tokens += len(ids)
            if len(ids):
                lowest, highest = min(lowest, int(ids.min())), max(highest, int(ids.max()))
            bar.update(len(lengths))
            if not terminal and time.monotonic() - last_line >= LOG_SECONDS:
                print(f"tokenising: {documents:,} documents, {tokens:,} tokens", file=sys.stderr,
                      flush=True)
                last_line = time.monotonic()
    return Written(documents, tokens, (lowest, highest))


def prepare_data(inputs: list[str | Span], tokenizer_model: str, output_prefix: str,
                 workers: int = 1, reading: Reading = BY_DEFAULT,
                 allow_lossy: bool = False) -> dict:
    """Tokenise the documents of ``inputs`` (in order; any format of ``pretrain.data.documents``,
    or a Span of a JSON-lines file; read as ``reading`` says) into ``output_prefix``.bin/.idx.

    A tokenizer that does not give back the text of the first documents is refused unless
    ``allow_lossy`` (``pretrain.data.round_trip``); the record then says so.

    Returns {"documents", "tokens" (EOD included), "dtype", "prefix", "empty_skipped"}, and
    "plain_text" (how many plain-text files were read whole, how many cut at blank lines)
    when an input is plain text, "lossy_tokenizer" when it was allowed.
    """
    require_creatable(output_prefix, "prepare-data --output", folder=False)
    bin_path, idx_path = Path(f"{output_prefix}.bin"), Path(f"{output_prefix}.idx")
    for path in (bin_path, idx_path):
        if path.exists():
            raise ConfigError(f"dataset file '{path}' already exists; choose another --output")
    if workers < 1:
        raise ConfigError(f"prepare-data workers ({workers}) must be >= 1")
    if not inputs:
        raise ConfigError("prepare-data needs at least one data file")
    for path in inputs:
        check_input(path, reading)
    tokenizer = open_tokenizer(tokenizer_model)
    lossy = _check_round_trip(inputs, reading, tokenizer, tokenizer_model, allow_lossy)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    bin_path.parent.mkdir(parents=True, exist_ok=True)
    tmp_bin, tmp_idx = (Path(f"{p}.tmp{os.getpid()}") for p in (bin_path, idx_path))
    skipped = Skipped()
    try:
        builder = IndexedDatasetBuilder(str(tmp_bin), dtype=dtype)
        # closed on any exit, Ctrl-C included: the workers are stopped before the error line,
        # not at interpreter shutdown
        with contextlib.closing(_encoded(inputs, tokenizer, workers, reading,
                                         skipped)) as chunks:
            written = _write(builder, chunks)
        builder.finalize(str(tmp_idx))
        for tmp, final in ((tmp_bin, bin_path), (tmp_idx, idx_path)):
            if final.exists():  # appeared while we worked: still never overwrite it
                raise ConfigError(f"dataset file '{final}' already exists; choose another "
                                  "--output")
            os.replace(tmp, final)
    finally:
        tmp_bin.unlink(missing_ok=True)
        tmp_idx.unlink(missing_ok=True)
    made = record.make(output_prefix, written.tokens, written.documents, written.ids, tokenizer)
    kept = {"lossy_tokenizer": True} if lossy else {}
    record.write(output_prefix, {**made, "empty_skipped": skipped.empty, **kept})
    plain = plain_text_counts(inputs, reading)
    return {"documents": written.documents, "tokens": written.tokens,
            "dtype": np.dtype(dtype).name, "prefix": output_prefix,
            "empty_skipped": skipped.empty, **({"plain_text": plain} if plain else {}), **kept}


def _check_round_trip(inputs: list[str | Span], reading: Reading, tokenizer, name: str,
                      allow_lossy: bool) -> bool:
    """Decode back the first round_trip.SAMPLE documents; a loss is refused in one line
    naming the document, unless ``allow_lossy`` (then said once). Returns whether any was
    lost."""
    for number, (path, text) in enumerate(islice(
            ((p, d) for p in inputs for d in iter_documents(p, reading)), round_trip.SAMPLE)):
        lost = round_trip.loss(tokenizer, text)
        if lost is None:
            continue
        where = f"document {number + 1} ('{path.path if isinstance(path, Span) else path}')"
        if not allow_lossy:
            raise DataError(
                f"tokenizer '{name}' does not give back the text it encodes: in {where} "
                f"{lost}; a model trained on its ids cannot write that text: use a lossless "
                "tokenizer (train-tokenizer's, or a byte-level BPE), or pass "
                "--allow-lossy-tokenizer to keep it (the dataset's record says so)")
        log.warning("tokenizer '%s' loses text (--allow-lossy-tokenizer): in %s %s", name,
                    where, lost)
        return True
    return False
