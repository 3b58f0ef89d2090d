"""Text -> Megatron indexed dataset (``.bin``/``.idx``), written by megatron-core's own builder.

Every document is followed by the tokenizer's EOD token and is one megatron document. The token
dtype is the one megatron picks for the vocabulary (``DType.optimal_dtype``: uint16 below 65,500
ids, else int32), so files made here and by Megatron-LM's preprocessing are interchangeable in
both directions. Output goes to temporary names and is renamed into place at the end; existing
outputs are never overwritten, so an interrupted or mistaken run loses nothing.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from itertools import islice
from multiprocessing import Pool
from pathlib import Path

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder
from tqdm import tqdm

from model.config import ConfigError
from pretrain.tokenizer import Tokenizer, iter_documents, require_data_file

# Documents read ahead per batch: bounds memory (the corpus is never held whole) while giving
# each worker enough work per round trip.
BATCH_DOCUMENTS = 2048
# Token ids scanned at once by check_dataset: bounded memory on arbitrarily large files.
SCAN_TOKENS = 1 << 26

_worker_tokenizer: Tokenizer | None = None


def _init_worker(model_file: str) -> None:
    """Load the tokenizer once per process rather than once per document."""
    global _worker_tokenizer
    _worker_tokenizer = Tokenizer(model_file)


def _encode(text: str) -> list[int]:
    assert _worker_tokenizer is not None
    return _worker_tokenizer.encode(text)


def _batches(inputs: list[str]) -> Iterator[list[str]]:
    documents = (doc for path in inputs for doc in iter_documents(path))
    while batch := list(islice(documents, BATCH_DOCUMENTS)):
        yield batch


def _encoded(inputs: list[str], tokenizer: Tokenizer,
             workers: int) -> Iterator[tuple[list[str], list[list[int]]]]:
    """(documents, ids) batches in input order. With workers, the next batch is tokenised while
    the caller writes the current one; at most two batches are in memory."""
    if workers == 1:
        for batch in _batches(inputs):
            yield batch, [tokenizer.encode(doc) for doc in batch]
        return
    with Pool(workers, _init_worker, (tokenizer.path,)) as pool:
        pending = None
        for batch in _batches(inputs):
            chunk = max(1, len(batch) // (4 * workers))
            submitted = (batch, pool.map_async(_encode, batch, chunksize=chunk))
            if pending:
                yield pending[0], pending[1].get()
            pending = submitted
        if pending:
            yield pending[0], pending[1].get()


def _write(builder: IndexedDatasetBuilder, batches: Iterable, eod: int) -> tuple[int, int]:
    documents = tokens = 0
    with tqdm(desc="tokenising", unit="doc", file=sys.stderr) as progress:
        for batch, encoded in batches:
            for ids in encoded:
                ids.append(eod)
                builder.add_item(torch.from_numpy(np.asarray(ids, dtype=np.int64)))
                builder.end_document()
                tokens += len(ids)
            documents += len(batch)
            progress.update(len(batch))
    return documents, tokens


def prepare_data(inputs: list[str], tokenizer_model: str, output_prefix: str,
                 workers: int = 1) -> dict:
    """Tokenise the documents of ``inputs`` (in order) into ``output_prefix``.bin/.idx.

    Returns {"documents", "tokens" (EOD included), "dtype", "prefix"}.
    """
    bin_path, idx_path = Path(f"{output_prefix}.bin"), Path(f"{output_prefix}.idx")
    for path in (bin_path, idx_path):
        if path.exists():
            raise ConfigError(f"dataset file '{path}' already exists; choose another --output")
    if workers < 1:
        raise ConfigError(f"prepare-data workers ({workers}) must be >= 1")
    if not inputs:
        raise ConfigError("prepare-data needs at least one data file")
    for path in inputs:
        require_data_file(path)
    tokenizer = Tokenizer(tokenizer_model)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    bin_path.parent.mkdir(parents=True, exist_ok=True)
    tmp_bin, tmp_idx = (Path(f"{p}.tmp{os.getpid()}") for p in (bin_path, idx_path))
    try:
        builder = IndexedDatasetBuilder(str(tmp_bin), dtype=dtype)
        documents, tokens = _write(builder, _encoded(inputs, tokenizer, workers), tokenizer.eod)
        builder.finalize(str(tmp_idx))
        for tmp, final in ((tmp_bin, bin_path), (tmp_idx, idx_path)):
            if final.exists():  # appeared while we worked: still never overwrite it
                raise ConfigError(f"dataset file '{final}' already exists; choose another "
                                  "--output")
            os.replace(tmp, final)
    finally:
        tmp_bin.unlink(missing_ok=True)
        tmp_idx.unlink(missing_ok=True)
    return {"documents": documents, "tokens": tokens, "dtype": np.dtype(dtype).name,
            "prefix": output_prefix}


def _open(prefix: str) -> IndexedDataset:
    for suffix in (".bin", ".idx"):
        if not Path(prefix + suffix).is_file():
            raise ConfigError(f"data file '{prefix}{suffix}' does not exist")
    try:
        return IndexedDataset(prefix)
    except Exception as err:  # megatron asserts (or fails to unpack) on malformed index files
        text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"data prefix '{prefix}' is not a readable Megatron indexed dataset "
                          f"({text})") from None


def check_dataset(prefix: str, vocab_size: int) -> int:
    """Check a dataset (ours or Megatron-LM's) before training on it; returns its number of
    documents. A .bin that does not match its .idx, or a token id outside the vocabulary,
    would otherwise surface mid-run as a read past the end or a CUDA index assertion."""
    index = _open(prefix).index
    dtype = np.dtype(index.dtype)
    count = int(index.sequence_pointers[-1]) // dtype.itemsize + int(index.sequence_lengths[-1]) \
        if len(index) else 0
    size = os.path.getsize(prefix + ".bin")
    if size != count * dtype.itemsize:
        raise ConfigError(f"data file '{prefix}.bin' has {size} bytes but '{prefix}.idx' "
                          f"describes {count * dtype.itemsize}")
    if count == 0:
        raise ConfigError(f"data prefix '{prefix}' holds no tokens")
    tokens = np.memmap(prefix + ".bin", dtype=dtype, mode="r", shape=(count,))
    for start in range(0, count, SCAN_TOKENS):
        chunk = tokens[start:start + SCAN_TOKENS]
        highest = int(chunk.max())
        if highest >= vocab_size:
            raise ConfigError(f"data prefix '{prefix}' has token id {highest} >= tokenizer "
                              f"vocab_size {vocab_size}")
        lowest = int(chunk.min()) if dtype.kind == "i" else 0
        if lowest < 0:
            raise ConfigError(f"data prefix '{prefix}' has negative token id {lowest}")
    return len(index.document_indices) - 1
