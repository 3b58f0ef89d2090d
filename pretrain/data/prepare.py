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
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator
from itertools import islice
from multiprocessing import Pool
from multiprocessing.pool import AsyncResult
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
# the few in flight (2 per worker) bound memory; the corpus is never held whole.
CHUNK_DOCUMENTS = 256
# Without a terminal (a log file) a progress bar is one long line of carriage returns: a plain
# line at most this often instead.
LOG_SECONDS = 30.0

_worker_tokenizer: Tokenizer | None = None


def _init_worker(model_file: str) -> None:
    """Load the tokenizer once per process rather than once per document, and leave Ctrl-C to
    the parent: a terminal sends SIGINT to the whole process group, and a worker interrupted
    mid-task prints its own traceback; the parent stops in one line and terminates the pool."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    global _worker_tokenizer
    _worker_tokenizer = open_tokenizer(model_file)


def _encode_chunk(tokenizer: Tokenizer, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(ids, lengths): every document's ids followed by EOD, concatenated. One flat buffer is
    what a worker sends back; pickling it costs a fraction of a list (or array) per document."""
    arrays = [np.array(tokenizer.encode(text) + [tokenizer.eod], dtype=np.int32)
              for text in texts]
    return np.concatenate(arrays), np.array([len(a) for a in arrays], dtype=np.int64)


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    assert _worker_tokenizer is not None
    return _encode_chunk(_worker_tokenizer, texts)


def _chunks(inputs: list[str | Span], reading: Reading,
            skipped: Skipped) -> Iterator[list[str]]:
    documents = (doc for path in inputs for doc in iter_documents(path, reading, skipped))
    while chunk := list(islice(documents, CHUNK_DOCUMENTS)):
        yield chunk


def _encoded(inputs: list[str | Span], tokenizer: Tokenizer, workers: int, reading: Reading,
             skipped: Skipped) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Encoded chunks in input order. Pool.imap would read the whole input ahead of the
    workers, so chunks are submitted by hand, at most two per worker ahead of the writer."""
    chunks = _chunks(inputs, reading, skipped)  # read here: ``skipped`` counts in this process
    if workers == 1:
        yield from (_encode_chunk(tokenizer, chunk) for chunk in chunks)
        return
    with Pool(workers, _init_worker, (tokenizer.path,)) as pool:
        window: deque[AsyncResult] = deque()
        for chunk in chunks:
            window.append(pool.apply_async(_encode_in_worker, (chunk,)))
            if len(window) > 2 * workers:
                yield window.popleft().get()
        while window:
            yield window.popleft().get()


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
        # closed on any exit, Ctrl-C included: the pool is terminated before the error line,
        # not at interpreter shutdown, where its threads print errors of their own
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
