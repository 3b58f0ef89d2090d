"""Token ids checked where they are read: every micro-batch, on the host, before it reaches
the device.

Why here and not only at the start: the start's vocabulary check (:mod:`pretrain.data.checks`)
reads the highest id from the dataset's record, which is trusted while the ``.bin`` keeps the
size and modification time it was recorded with. Ids written into a ``.bin`` in place with its
time kept (``cp -p`` of a damaged copy, a restored backup, bit rot) pass it and reach the
embedding: ``IndexError: index out of range in self`` at step 1 on the CPU, a device-side
assert naming no file on a GPU. The smallest and largest id of a micro-batch's tokens and
labels cost microseconds (``python -m bench.batch_id_check``, docs/data.md), under a
thousandth of a CPU step, and in training the read runs in the prefetch thread while the
previous step computes. Only a failure pays for mapping the sample back to its prefix,
document and position through megatron's blending, shuffle, sample and document indices.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from megatron.core.datasets.blended_dataset import BlendedDataset

from runtime.errors import DataError


def check_batch(batch: dict[str, torch.Tensor], dataset, samples: list[int]) -> None:
    """Refuse a micro-batch (host tensors; ``samples``: its rows' indices into ``dataset``)
    holding a token or label outside the tokenizer's vocabulary, in one line naming where the
    id lies in the data."""
    vocab = dataset.config.tokenizer.vocab_size
    if all(_in_range(batch[key], vocab) for key in ("tokens", "labels")):
        return
    row, position, value = _first_bad(batch, vocab)
    raise DataError(_refusal(dataset, samples[row], position, value, vocab))


def _in_range(ids: torch.Tensor, vocab: int) -> bool:
    low, high = torch.aminmax(ids)
    return bool(low >= 0) and bool(high < vocab)


def _first_bad(batch: dict[str, torch.Tensor], vocab: int) -> tuple[int, int, int]:
    """(row, position in the sample's text, id) of the first id out of range. A sample's text
    is its seq_length + 1 tokens read from the data: the tokens, then the last label."""
    text = torch.cat([batch["tokens"], batch["labels"][:, -1:]], dim=1)
    row, position = ((text < 0) | (text >= vocab)).nonzero()[0].tolist()
    return row, position, int(text[row, position])


class Place(NamedTuple):
    """Where a token of a sample lies in its prefix's files."""

    document: int
    token_of_document: int
    token_of_bin: int


def _refusal(dataset, sample: int, position: int, value: int, vocab: int) -> str:
    rule = "< 0" if value < 0 else f">= tokenizer vocab_size {vocab}"
    gpt, inner = _member(dataset, sample)
    prefix = gpt.dataset_path
    place = locate(gpt, inner, position, value)
    where = (f"in document {place.document:,} at its token {place.token_of_document:,} "
             f"(token {place.token_of_bin:,} of '{prefix}.bin')" if place is not None else
             f"at token {position} of its sample {inner}")
    return (f"data prefix '{prefix}' has token id {value} {rule} {where}, read for the "
            f"{gpt.index_split.name} split: the .bin changed after its record was made, "
            "keeping its size and time, so the start's check passed; prepare the data again")


def _member(dataset, sample: int) -> tuple:
    """(GPTDataset, its sample index) behind ``sample`` of ``dataset``: a blend names the
    dataset and its sample in its dataset and dataset-sample indices."""
    if isinstance(dataset, BlendedDataset):
        if dataset.dataset_index is None:
            dataset[sample]  # megatron maps its indices at the first read
        member = dataset.datasets[int(dataset.dataset_index[sample])]
        return member, int(dataset.dataset_sample_index[sample])
    return dataset, sample


def locate(gpt, sample: int, position: int, value: int) -> Place | None:
    """Where token ``position`` of ``sample`` of the GPTDataset ``gpt`` lies: megatron's
    shuffle index gives the sample's row of the sample index, whose entries (index into the
    document index, offset) bound the sequences it reads. None when the token is padding or
    the id found there is not ``value`` (a mapping megatron changed): the caller then names
    the sample."""
    row = int(gpt.shuffle_index[sample])
    (first, first_offset), (last, last_offset) = gpt.sample_index[row], gpt.sample_index[row + 1]
    extra = int(gpt.config.add_extra_token_to_sequence)
    indexed = gpt.dataset
    for entry in range(int(first), int(last) + 1):
        sequence = int(gpt.document_index[entry])
        begin = int(first_offset) if entry == first else 0
        end = int(last_offset) + extra if entry == last else int(
            indexed.sequence_lengths[sequence])
        if position < end - begin:
            return _place(indexed, sequence, begin + position, value)
        position -= end - begin
    return None


def _place(indexed, sequence: int, offset: int, value: int) -> Place | None:
    """Token ``offset`` of ``sequence`` as a document's token and a token of the .bin, if it
    holds ``value``."""
    if int(indexed.get(sequence, offset=offset, length=1)[0]) != value:
        return None
    starts = indexed.document_indices
    document = int(np.searchsorted(starts, sequence, side="right")) - 1
    before = int(indexed.sequence_lengths[int(starts[document]):sequence].sum())
    pointer = int(indexed.index.sequence_pointers[sequence]) // indexed.index.dtype_size
    return Place(document, before + offset, pointer + offset)
