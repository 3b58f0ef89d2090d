"""Text -> Megatron indexed dataset (``.bin``/``.idx``), written by megatron-core's own builder.

Every document is followed by the tokenizer's EOD token. The token dtype is the one megatron
chooses for the vocabulary (uint16 below 65,500 ids, else int32), so files made here and files
made by Megatron-LM's preprocessing are interchangeable. Output goes to temporary names and is
renamed into place at the end; existing outputs are never overwritten.
"""

from __future__ import annotations

import os
from multiprocessing import Pool
from pathlib import Path

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder
from tqdm import tqdm

from model.config import ConfigError
from pretrain.tokenizer import Tokenizer, iter_documents

_worker_tokenizer: Tokenizer | None = None


def _init_worker(model_file: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = Tokenizer(model_file)


def _encode(text: str) -> list[int]:
    assert _worker_tokenizer is not None
    return _worker_tokenizer.encode(text) + [_worker_tokenizer.eod]


def prepare_data(inputs: list[str], tokenizer_model: str, output_prefix: str,
                 workers: int = 1) -> dict:
    """Tokenise ``inputs`` (in order) into ``output_prefix``.bin/.idx; returns a summary."""
    bin_path, idx_path = Path(f"{output_prefix}.bin"), Path(f"{output_prefix}.idx")
    for path in (bin_path, idx_path):
        if path.exists():
            raise ConfigError(f"dataset file '{path}' already exists; choose another --output")
    if workers < 1:
        raise ConfigError(f"prepare-data --workers ({workers}) must be >= 1")
    tokenizer = Tokenizer(tokenizer_model)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    documents = [doc for path in inputs for doc in iter_documents(path)]
    if not documents:
        raise ConfigError(f"data files {inputs} contain no documents")
    bin_path.parent.mkdir(parents=True, exist_ok=True)
    tmp_bin, tmp_idx = Path(f"{bin_path}.tmp{os.getpid()}"), Path(f"{idx_path}.tmp{os.getpid()}")
    builder = IndexedDatasetBuilder(str(tmp_bin), dtype=dtype)
    tokens = 0
    _init_worker(tokenizer_model)
    pool = Pool(workers, _init_worker, (tokenizer_model,)) if workers > 1 else None
    try:
        encoded = pool.imap(_encode, documents, chunksize=16) if pool else map(_encode,
                                                                               documents)
        for ids in tqdm(encoded, total=len(documents), desc="tokenising", unit="doc"):
            builder.add_item(torch.tensor(ids, dtype=torch.int64))
            builder.end_document()
            tokens += len(ids)
        builder.finalize(str(tmp_idx))
        os.replace(tmp_bin, bin_path)
        os.replace(tmp_idx, idx_path)
    finally:
        if pool:
            pool.close()
        for tmp in (tmp_bin, tmp_idx):
            tmp.unlink(missing_ok=True)
    return {"documents": len(documents), "tokens": tokens, "dtype": np.dtype(dtype).name,
            "prefix": output_prefix}


def check_dataset(prefix: str, vocab_size: int) -> int:
    """Open a dataset with megatron's reader and check every token id fits the vocabulary;
    returns its number of documents."""
    for suffix in (".bin", ".idx"):
        if not Path(prefix + suffix).is_file():
            raise ConfigError(f"data file '{prefix}{suffix}' does not exist")
    try:
        dataset = IndexedDataset(prefix)
    except Exception as err:  # megatron asserts on malformed index files
        text = str(err).strip()
        raise ConfigError(f"data prefix '{prefix}' is not a readable indexed dataset: "
                          f"{text.splitlines()[0] if text else type(err).__name__}") from None
    # The .bin file is the token array itself; scan it memory-mapped, not token by token.
    tokens = np.memmap(prefix + ".bin", dtype=dataset.index.dtype, mode="r")
    if tokens.size == 0:
        raise ConfigError(f"data prefix '{prefix}' holds no tokens")
    highest = int(tokens.max())
    if highest >= vocab_size:
        raise ConfigError(f"data prefix '{prefix}' has token id {highest} >= tokenizer "
                          f"vocab_size {vocab_size}")
    return len(dataset.index.document_indices) - 1
