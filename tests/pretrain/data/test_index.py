"""The structural check of a Megatron .idx (pretrain/data/index.py): a sound index written by
megatron's own builder passes with its counts; damage of the kind a user met (64 bytes of 0xff
over an index of the same size, which used to pass every start check and fail the first step
in the embedding) is one DataError naming the file and the first bad entry, wherever in the
arrays it lands."""

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

from pretrain.data import index
from runtime.errors import DataError

# Documents of 1-3 sequences of varied lengths (a zero-length sequence too).
DOCUMENTS = [[[5, 6, 7], [8]], [[9, 10, 11, 12]], [[13], [], [14, 15]], [[16, 17]]]


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("index") / "corpus")
    builder = IndexedDatasetBuilder(path + ".bin", dtype=np.uint16)
    for document in DOCUMENTS:
        for sequence in document:
            builder.add_item(torch.tensor(sequence, dtype=torch.int64))
        builder.end_document()
    builder.finalize(path + ".idx")
    return path


def test_a_sound_index_passes_with_megatrons_counts(prefix):
    checked = index.read(prefix + ".idx")
    theirs = IndexedDataset(prefix)
    assert checked.dtype == np.uint16
    assert checked.document_count == len(DOCUMENTS) == len(theirs.document_indices) - 1
    assert list(checked.lengths) == list(theirs.sequence_lengths)
    assert list(checked.pointers) == list(theirs.index.sequence_pointers)
    assert checked.tokens == sum(len(s) for d in DOCUMENTS for s in d)


def _damaged(prefix: str, tmp_path, offset: int, data: bytes = b"\xff" * 64) -> str:
    raw = bytearray(open(prefix + ".idx", "rb").read())
    raw[offset:offset + len(data)] = data[:len(raw) - offset]
    path = tmp_path / "damaged.idx"
    path.write_bytes(bytes(raw))
    return str(path)


def _regions(prefix: str) -> dict[str, int]:
    """Where each array of the index starts (bytes)."""
    checked = index.read(prefix + ".idx")
    sequences = len(checked.lengths)
    lengths = index.HEADER.size
    return {"lengths": lengths, "pointers": lengths + 4 * sequences,
            "documents": lengths + 12 * sequences}


@pytest.mark.parametrize(("region", "skip", "width", "message"), [
    ("lengths", 4, 64, "sequence 1 has length -1"),
    ("pointers", 8, 64, "sequence 1 starts at byte -1, the lengths before it put it at 6"),
    ("documents", 16, 8, "document 2 starts at sequence -1, before document 1 (2)"),
    ("documents", 0, 64, "its document index runs from -1 to -1"),
])
def test_each_kind_of_damage_names_the_file_and_first_bad_entry(prefix, tmp_path, region,
                                                                  skip, width, message):
    damaged = _damaged(prefix, tmp_path, _regions(prefix)[region] + skip, b"\xff" * width)
    with pytest.raises(DataError) as err:
        index.read(damaged)
    text = str(err.value)
    assert text.startswith(f"data file '{damaged}' is damaged: ") and message in text
    assert "\n" not in text


def test_ff_bytes_anywhere_past_the_header_are_caught(prefix, tmp_path):
    """Every position of a 64-byte 0xff overwrite (and of an 8-byte one) in the arrays."""
    size = len(open(prefix + ".idx", "rb").read())
    for width in (64, 8):
        for offset in range(index.HEADER.size, size - 1):
            damaged = _damaged(prefix, tmp_path, offset, b"\xff" * width)
            with pytest.raises(DataError, match="is damaged"):
                index.read(damaged)


@pytest.mark.parametrize(("field", "value", "message"), [
    (9, (2).to_bytes(8, "little"), "truncated or damaged"),  # version
    (17, bytes([42]), "token dtype code 42"),
    (18, (10**6).to_bytes(8, "little"), "truncated or damaged"),  # sequence count
])
def test_a_damaged_header_is_named(prefix, tmp_path, field, value, message):
    damaged = _damaged(prefix, tmp_path, field, value)
    with pytest.raises(DataError, match=message):
        index.read(damaged)


class _Tokenizer:
    eod = 2


def test_document_attention_on_data_without_end_of_document_tokens_is_said_once(
        prefix, tmp_path, caplog):
    """data.document_attention on data whose documents do not end with the tokenizer's
    end-of-document token: one warning naming the prefix (it used to train silently as
    one document per sequence); data whose documents end with it: nothing."""
    from pretrain.data.checks import _check_documents_end

    ending = str(tmp_path / "ending")
    builder = IndexedDatasetBuilder(ending + ".bin", dtype=np.uint16)
    for document in DOCUMENTS:
        for sequence in document[:-1]:
            builder.add_item(torch.tensor(sequence, dtype=torch.int64))
        builder.add_item(torch.tensor([*document[-1], _Tokenizer.eod], dtype=torch.int64))
        builder.end_document()
    builder.finalize(ending + ".idx")
    indices = [index.read(p + ".idx") for p in (prefix, ending)]
    with caplog.at_level("WARNING", logger="pretrain"):
        _check_documents_end([prefix, ending], indices, _Tokenizer())
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1
    assert warned[0].startswith("data.document_attention is on, but none of the first 64 "
                                "documents of 1 data prefix ends with the end-of-document "
                                "token (id 2)") and warned[0].endswith(f"({prefix})")
    caplog.clear()
    with caplog.at_level("WARNING", logger="pretrain"):
        _check_documents_end([ending], indices[1:], _Tokenizer())
    assert not caplog.records
