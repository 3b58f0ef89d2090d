"""Datasets and tokenizer stand-ins for the data tests."""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import SimpleNamespace

import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder


def stub_tokenizer(vocab_size: int, name: str = "stub") -> SimpleNamespace:
    """What the dataset checks read of a tokenizer: its path, size and content hash, and
    (a training start's round-trip check) an encoding that gives back its text."""
    return SimpleNamespace(path=f"{name}.model", vocab_size=vocab_size,
                           unique_identifiers={"model_sha256": hashlib.sha256(
                               f"{name}:{vocab_size}".encode()).hexdigest()},
                           encode=lambda text: list(text.encode()),
                           decode=lambda ids: bytes(ids).decode())


def megatron_dataset(prefix: Path, documents: list[list[list[int]]], dtype) -> None:
    """Write a dataset the way Megatron-LM's preprocess_data.py does: one add_document per
    document, each made of one or more sequences (and no record)."""
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for sequences in documents:
        flat = torch.tensor([t for seq in sequences for t in seq], dtype=torch.int64)
        builder.add_document(flat, [len(seq) for seq in sequences])
    builder.finalize(f"{prefix}.idx")
