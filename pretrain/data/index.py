"""A Megatron ``.idx`` file read and checked on its own, before megatron opens it.

Layout (what megatron's IndexedDatasetBuilder writes): the magic ``MMIDIDX\\x00\\x00``, version
1 (uint64), the token dtype code (uint8), the sequence count S and the document-index length
D + 1 (uint64 each), then S int32 sequence lengths, S int64 byte pointers into the ``.bin``,
and D + 1 int64 document indices (sequence numbers where each document starts, then S).

megatron trusts every number: a negative length or a pointer past the ``.bin`` becomes a read
of the wrong tokens (or of bytes that are not tokens) deep inside training, where it surfaces
as an index error in the embedding. :func:`read` checks every structural fact with a few
vectorised passes over the memory-mapped arrays (0.1-0.3 s for ten million sequences on a
2-core CPU, docs/data.md) and names the first entry that breaks one.
"""

from __future__ import annotations

import os
import struct
from typing import NamedTuple

import numpy as np

from runtime.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
HEADER = struct.Struct("<9sQBQQ")
# megatron's DType codes (megatron.core.datasets.indexed_dataset.DType).
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
          7: np.float32, 8: np.uint16}


class Index(NamedTuple):
    """The checked arrays of one ``.idx`` (memory-mapped) and the token count they describe."""

    dtype: np.dtype
    lengths: np.ndarray
    pointers: np.ndarray
    documents: np.ndarray
    tokens: int

    @property
    def document_count(self) -> int:
        return len(self.documents) - 1


def _header(path: str) -> tuple[np.dtype, int, int]:
    """(token dtype, sequences, document-index length), the header agreeing with the size."""
    with open(path, "rb") as f:
        head = f.read(HEADER.size)
    if len(head) < HEADER.size or not head.startswith(MAGIC):
        raise DataError(f"data file '{path}' is not a Megatron index (bad header)")
    _, version, code, sequences, entries = HEADER.unpack(head)
    expected = HEADER.size + sequences * (4 + 8) + entries * 8
    size = os.path.getsize(path)
    if version != 1 or size != expected:
        raise DataError(f"data file '{path}' is truncated or damaged: {size} bytes, its "
                        f"header describes {expected} (version {version})")
    if code not in DTYPES:
        raise DataError(f"data file '{path}' is damaged: token dtype code {code} is not one "
                        f"of megatron's ({', '.join(map(str, DTYPES))})")
    return np.dtype(DTYPES[code]), sequences, entries


def _first(bad: np.ndarray) -> int:
    return int(np.flatnonzero(bad)[0])


def read(path: str) -> Index:
    """The index at ``path`` (``PREFIX.idx``) with every structural fact checked: header,
    size, non-negative lengths, each sequence's pointer right after the one before it,
    document indices from 0, non-decreasing, to the sequence count. One DataError line naming
    the file and the first bad entry otherwise. The ``.bin`` is not opened."""
    dtype, sequences, entries = _header(path)
    offset = HEADER.size
    lengths = np.memmap(path, np.int32, "r", offset, (sequences,)) if sequences else \
        np.zeros(0, np.int32)
    offset += sequences * 4
    pointers = np.memmap(path, np.int64, "r", offset, (sequences,)) if sequences else \
        np.zeros(0, np.int64)
    offset += sequences * 8
    documents = np.memmap(path, np.int64, "r", offset, (entries,)) if entries else \
        np.zeros(0, np.int64)
    if (lengths < 0).any():
        i = _first(lengths < 0)
        raise DataError(f"data file '{path}' is damaged: sequence {i} has length {lengths[i]}")
    # Sequences are stored back to back: pointer i is the bytes of the sequences before it.
    expected = np.zeros(sequences, np.int64)
    np.cumsum(lengths[:-1], dtype=np.int64, out=expected[1:])
    expected *= dtype.itemsize
    if sequences and (pointers != expected).any():
        i = _first(pointers != expected)
        raise DataError(f"data file '{path}' is damaged: sequence {i} starts at byte "
                        f"{pointers[i]}, the lengths before it put it at {expected[i]}")
    if entries == 0 or documents[0] != 0 or documents[-1] != sequences:
        first, last = (int(documents[0]), int(documents[-1])) if entries else (None, None)
        raise DataError(f"data file '{path}' is damaged: its document index runs from {first} "
                        f"to {last}, not from 0 to its {sequences} sequences")
    if (np.diff(documents) < 0).any():
        i = _first(np.diff(documents) < 0) + 1
        raise DataError(f"data file '{path}' is damaged: document {i} starts at sequence "
                        f"{documents[i]}, before document {i - 1} ({documents[i - 1]})")
    tokens = int(expected[-1]) // dtype.itemsize + int(lengths[-1]) if sequences else 0
    return Index(dtype, lengths, pointers, documents, tokens)
