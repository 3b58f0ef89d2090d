"""A ``.idx`` that changed under its record (pretrain/data/record.py): its fingerprint is
compared at every start, so another dataset's index with the same sequence count and token
total no longer trains silently (the start used to compare it only where a size or time
differed, and then said only ``record ... (contents changed); scanning``). Beside an
unchanged ``.bin`` it is refused in one line saying what changed and the fix, and the fix run
as written then trains; where both files changed, one warning says what changed."""

from __future__ import annotations

import logging
import os
import re
import shutil

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from pretrain.data import record
from pretrain.data.checks import check_dataset
from runtime.errors import DataError
from tests.pretrain.data.datasets import megatron_dataset, stub_tokenizer
from tests.pretrain_fixtures import cli, train_args, train_losses


def _reordered(source: str, folder) -> str:
    """Another dataset: the documents of ``source`` in reverse order, so the same sequence
    count and token total."""
    theirs = IndexedDataset(source)
    documents = [[theirs[i].tolist()] for i in range(len(theirs))][::-1]
    megatron_dataset(folder / "reordered", documents, theirs.index.dtype)
    return str(folder / "reordered")


@pytest.mark.slow
def test_another_datasets_index_beside_an_unchanged_bin_is_refused_then_trains_as_advised(
        data, tmp_path):
    prefix = str(tmp_path / "topics")
    for suffix in (".bin", ".idx", record.SUFFIX):
        shutil.copy2(data["prefix"] + suffix, prefix + suffix)
    saved = record.read(prefix)
    other = _reordered(prefix, tmp_path)
    shutil.copy2(other + ".idx", prefix + ".idx")
    # and the recorded time (touch -r of a backup): only the contents tell
    os.utime(prefix + ".idx", ns=(saved["files"]["idx"][1], saved["files"]["idx"][1]))
    assert record.file_state(prefix) == saved["files"]
    args = train_args({**data, "prefix": prefix}, tmp_path / "run", "--run.steps=3")
    refused = cli(*args, check=False)
    assert refused.returncode == 2, refused.stderr[-3000:]
    last = refused.stderr.strip().splitlines()[-1]
    path = f"{prefix}{record.SUFFIX}"
    assert last == (
        f"error: data prefix '{prefix}': '{prefix}.idx' is not the index its record '{path}' "
        f"was made with (the same {saved['documents']:,} documents and {saved['tokens']:,} "
        f"tokens, other contents) while '{prefix}.bin' is unchanged (the recorded size and "
        "time): the index belongs to other data; prepare the data again, or, if the change "
        f"was deliberate, delete '{path}' and the next start scans the dataset again")
    assert not (tmp_path / "run").exists()  # refused before the run folder is written
    os.unlink(re.search(r"delete '([^']+)'", last).group(1))  # the advice, as written
    cli(*args)
    assert sorted(train_losses(tmp_path / "run")) == [1, 2, 3]


def _foreign(folder, documents=((5, 499, 7), (1, 2)), name="foreign") -> str:
    """A dataset as Megatron-LM writes it (no record), one sequence per document."""
    megatron_dataset(folder / name, [[list(d)] for d in documents], np.uint16)
    return str(folder / name)


def _recorded(folder) -> str:
    prefix = _foreign(folder)
    record.write(prefix, record.make(prefix, 5, 2, (1, 499), stub_tokenizer(500, "maker")))
    return prefix


def _index_of(prefix: str, folder, documents) -> None:
    """``prefix``'s .idx replaced by that of ``documents`` (the same tokens, cut otherwise),
    the .bin untouched."""
    other = _foreign(folder, documents, "other")
    shutil.copy2(other + ".idx", prefix + ".idx")


def test_other_counts_in_an_index_under_an_unchanged_bin_are_named(tmp_path, scans):
    prefix = _recorded(tmp_path)
    _index_of(prefix, tmp_path, ((5,), (499, 7), (1, 2)))
    with pytest.raises(DataError) as info:
        check_dataset(prefix, stub_tokenizer(500, "maker"))
    assert str(info.value).startswith(
        f"data prefix '{prefix}': '{prefix}.idx' is not the index its record "
        f"'{prefix}{record.SUFFIX}' was made with (3 documents, recorded 2) while")
    assert scans == []


def test_an_index_whose_time_alone_changed_is_trusted(tmp_path, scans):
    prefix = _recorded(tmp_path)
    os.utime(prefix + ".idx", ns=(0, 10**9))  # a copy of the .idx without -p
    assert check_dataset(prefix, stub_tokenizer(500, "maker")).tokenizer["path"] == "maker.model"
    assert scans == []


def test_both_files_changed_is_one_warning_saying_what(tmp_path, scans, caplog):
    prefix = _recorded(tmp_path)
    for suffix in (".bin", ".idx"):
        os.unlink(prefix + suffix)
    _foreign(tmp_path, ((3, 4), (5, 6, 7, 8), (9,)))
    with caplog.at_level(logging.INFO, logger="pretrain"):
        assert check_dataset(prefix, stub_tokenizer(500, "other")).tokenizer is None
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning == (
        f"data prefix {prefix} changed since its record {prefix}{record.SUFFIX}: {prefix}.idx "
        f"(3 documents, recorded 2; 7 tokens, recorded 5) and {prefix}.bin (14 bytes, "
        "recorded 10); scanning its 7 tokens again, the tokenizer that made it is no longer "
        "known")
    assert scans == [7]
