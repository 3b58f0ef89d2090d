"""The checks a dataset passes before a run reads it (ours or Megatron-LM's): files that agree,
token ids within the tokenizer's vocabulary, and the tokenizer that made it.

A .bin that does not match its .idx, or a token id outside the vocabulary, would otherwise
surface mid-run as a read past the end or a CUDA index assertion; data made with another
tokenizer whose ids happen to fit would train silently on meaningless text. Every check costs
the same at any corpus size: the token ids come from the dataset's record
(:mod:`pretrain.data.record`), scanned once when there is none.
"""

from __future__ import annotations

import os
import struct
from typing import Any, NamedTuple

import numpy as np
from megatron.core.datasets.indexed_dataset import IndexedDataset

from pretrain.data import record
from pretrain.paths import require_file
from runtime.errors import DataError

# The .idx layout megatron writes: magic, version 1, dtype code, then the sequence and
# document counts, then int32 lengths, int64 pointers (one per sequence), int64 document starts.
INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_HEADER = struct.Struct("<9sQBQQ")


class Checked(NamedTuple):
    """What the checks of one prefix found: its documents and tokens, and the tokenizer its
    record names (None: made elsewhere, or before records existed)."""

    documents: int
    tokens: int
    tokenizer: dict[str, Any] | None


def check_index(path: str) -> None:
    """The .idx header and size agree, checked before megatron opens it: its reader asserts on
    a bad file and then fails again in ``__del__``, printing a traceback after our error."""
    with open(path, "rb") as f:
        head = f.read(INDEX_HEADER.size)
    if len(head) < INDEX_HEADER.size or not head.startswith(INDEX_MAGIC):
        raise DataError(f"data file '{path}' is not a Megatron index (bad header)")
    _, version, _, sequences, documents = INDEX_HEADER.unpack(head)
    expected = INDEX_HEADER.size + sequences * (4 + 8) + documents * 8
    size = os.path.getsize(path)
    if version != 1 or size != expected:
        raise DataError(f"data file '{path}' is truncated or damaged: {size} bytes, its "
                        f"header describes {expected} (version {version})")


def open_dataset(prefix: str) -> IndexedDataset:
    check_files(prefix)
    try:
        return IndexedDataset(prefix)
    except Exception as err:  # megatron asserts (or fails to unpack) on malformed index files
        text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataError(f"data prefix '{prefix}' is not a readable Megatron indexed dataset "
                        f"({text})") from None


def check_files(prefix: str) -> None:
    """Both files exist and the .idx is whole: the checks that read no tokens, run over every
    prefix of a blend first so a missing file among a hundred fails before any scan."""
    for suffix in (".bin", ".idx"):
        require_file(prefix + suffix, "data file", DataError)
    check_index(prefix + ".idx")


def check_dataset(prefix: str, tokenizer) -> Checked:
    """Check ``prefix`` against ``tokenizer`` (its ``vocab_size``, and its content hash against
    the tokenizer the dataset's record names)."""
    index = open_dataset(prefix).index
    dtype = np.dtype(index.dtype)
    count = int(index.sequence_pointers[-1]) // dtype.itemsize + int(index.sequence_lengths[-1]) \
        if len(index) else 0
    size = os.path.getsize(prefix + ".bin")
    if size != count * dtype.itemsize:
        raise DataError(f"data file '{prefix}.bin' has {size} bytes but '{prefix}.idx' "
                        f"describes {count * dtype.itemsize} (truncated or damaged)")
    if count == 0:
        raise DataError(f"data prefix '{prefix}' holds no tokens")
    documents = len(index.document_indices) - 1
    tokens = np.memmap(prefix + ".bin", dtype=dtype, mode="r", shape=(count,))
    facts = record.current(prefix, tokens, documents)
    if facts["tokens"] != count or facts["documents"] != documents:
        raise DataError(f"data record '{record.path_of(prefix)}' describes {facts['tokens']:,} "
                        f"tokens in {facts['documents']:,} documents, '{prefix}.idx' "
                        f"{count:,} in {documents:,}; delete the record to scan again")
    made_by = facts["tokenizer"]
    current = record.tokenizer_entry(tokenizer)
    if made_by is not None and made_by["sha256"] != current["sha256"]:
        raise DataError(
            f"data prefix '{prefix}' was made with another tokenizer: '{made_by['path']}' "
            f"#{made_by['sha256'][:8]} ({made_by['vocab_size']:,} pieces), data.tokenizer is "
            f"'{current['path']}' #{current['sha256'][:8]} ({current['vocab_size']:,} "
            "pieces); prepare the data again with data.tokenizer, or set it to the data's")
    if facts["max_id"] >= tokenizer.vocab_size:
        raise DataError(f"data prefix '{prefix}' has token id {facts['max_id']} >= tokenizer "
                        f"vocab_size {tokenizer.vocab_size}")
    if facts["min_id"] < 0:
        raise DataError(f"data prefix '{prefix}' has negative token id {facts['min_id']}")
    return Checked(documents, count, made_by)
