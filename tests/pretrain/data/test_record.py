"""The dataset record (PREFIX.record.json): which tokenizer made a dataset and its token-id
range, so a start checks both without reading the corpus; a dataset made elsewhere is scanned
once, a changed one again, a damaged record is refused."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from pretrain.data import record
from pretrain.data.checks import check_dataset
from pretrain.data.tokenizer import open_tokenizer
from runtime.errors import DataError
from tests.pretrain.data.datasets import megatron_dataset, stub_tokenizer


def _copy(data: dict, folder) -> str:
    """The session's prepared dataset, copied with its times (so its record still holds)."""
    source = data["prefix"]
    for suffix in (".bin", ".idx", record.SUFFIX):
        shutil.copy2(source + suffix, folder / ("data" + suffix))
    return str(folder / "data")


def _foreign(folder, tokens=((5, 499, 7), (1, 2))) -> str:
    """A dataset as Megatron-LM writes it: no record."""
    prefix = folder / "foreign"
    megatron_dataset(prefix, [[list(t)] for t in tokens], np.uint16)
    return str(prefix)


def test_prepared_dataset_records_its_tokenizer_and_token_ids(data):
    saved = json.loads(open(data["prefix"] + record.SUFFIX).read())
    tokens = np.fromfile(data["prefix"] + ".bin", dtype=np.uint16)
    tokenizer = open_tokenizer(data["tokenizer"])
    assert saved["tokenizer"]["sha256"] == tokenizer.unique_identifiers["model_sha256"]
    assert saved["tokenizer"]["vocab_size"] == tokenizer.vocab_size
    assert (saved["min_id"], saved["max_id"]) == (int(tokens.min()), int(tokens.max()))
    assert saved["tokens"] == len(tokens)


def test_a_start_reads_no_token_of_a_recorded_dataset(data, tmp_path, scans):
    prefix = _copy(data, tmp_path)
    checked = check_dataset(prefix, open_tokenizer(data["tokenizer"]))
    assert scans == []
    assert checked.tokens == os.path.getsize(prefix + ".bin") // 2


def test_data_made_with_another_tokenizer_is_refused_naming_both(data, tmp_path):
    prefix = _copy(data, tmp_path)
    other = stub_tokenizer(70_000, "big")
    made_by = open_tokenizer(data["tokenizer"])
    with pytest.raises(DataError) as info:
        check_dataset(prefix, other)
    message = str(info.value)
    assert "\n" not in message
    assert f"data prefix '{prefix}' was made with another tokenizer" in message
    assert f"'{made_by.path}' #{made_by.unique_identifiers['model_sha256'][:8]}" in message
    assert f"'big.model' #{other.unique_identifiers['model_sha256'][:8]}" in message


def test_a_dataset_made_elsewhere_is_scanned_once(tmp_path, scans):
    prefix = _foreign(tmp_path)
    assert check_dataset(prefix, stub_tokenizer(500)).tokenizer is None
    assert check_dataset(prefix, stub_tokenizer(600)).tokenizer is None
    assert scans == [5]
    saved = json.loads(open(prefix + record.SUFFIX).read())
    assert (saved["min_id"], saved["max_id"], saved["tokenizer"]) == (1, 499, None)
    with pytest.raises(DataError, match="has token id 499 >= tokenizer vocab_size 300"):
        check_dataset(prefix, stub_tokenizer(300))  # from the record: no scan
    assert scans == [5]


def test_a_changed_bin_is_scanned_again(tmp_path, scans):
    prefix = _foreign(tmp_path, tokens=((5, 9, 7), (1, 2)))
    check_dataset(prefix, stub_tokenizer(300))
    tokens = np.memmap(prefix + ".bin", dtype=np.uint16, mode="r+")
    tokens[1] = 450  # same size: only the time tells
    tokens.flush()
    del tokens
    stat = os.stat(prefix + ".bin")
    os.utime(prefix + ".bin", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.raises(DataError, match="has token id 450 >= tokenizer vocab_size 300"):
        check_dataset(prefix, stub_tokenizer(300))
    assert scans == [5, 5]


def test_a_copied_dataset_keeps_its_tokenizer(tmp_path, scans):
    prefix = _foreign(tmp_path)
    made_by = stub_tokenizer(500, "maker")
    record.write(prefix, record.make(prefix, 5, 2, (1, 499), made_by))
    os.utime(prefix + ".bin", ns=(0, 10**9))  # what a copy without -p does
    with pytest.raises(DataError, match="'maker.model'"):
        check_dataset(prefix, stub_tokenizer(500, "other"))
    assert check_dataset(prefix, made_by).tokenizer["path"] == "maker.model"
    assert scans == [5]  # the new time recorded once


def test_a_copied_dataset_keeps_what_its_preparation_allowed(tmp_path, scans):
    """A .bin copied without its time is scanned again; the record it writes keeps, with the
    tokenizer, the lossy tokenizer its preparation allowed and the empty documents it
    skipped (a scan cannot tell them), so the next start still trains on it."""
    prefix = _foreign(tmp_path)
    made_by = stub_tokenizer(500, "maker")
    record.write(prefix, {**record.make(prefix, 5, 2, (1, 499), made_by),
                          "lossy_tokenizer": True, "empty_skipped": 3})
    os.utime(prefix + ".bin", ns=(0, 10**9))
    check_dataset(prefix, made_by)
    saved = record.read(prefix)
    assert (saved["lossy_tokenizer"], saved["empty_skipped"]) == (True, 3)
    assert saved["tokenizer"]["path"] == "maker.model" and scans == [5]


def test_another_tokenisation_loses_the_tokenizer(tmp_path):
    prefix = _foreign(tmp_path)
    record.write(prefix, record.make(prefix, 5, 2, (1, 499), stub_tokenizer(500, "maker")))
    for suffix in (".bin", ".idx"):
        os.unlink(prefix + suffix)
    _foreign(tmp_path, tokens=((3, 4), (5, 6, 7, 8)))
    assert check_dataset(prefix, stub_tokenizer(500, "other")).tokenizer is None


def test_a_damaged_record_is_refused(tmp_path):
    prefix = _foreign(tmp_path)
    path = tmp_path / ("foreign" + record.SUFFIX)
    for text in ("{not json", json.dumps({"version": 1, "tokens": 5})):
        path.write_text(text)
        with pytest.raises(DataError) as info:
            check_dataset(prefix, stub_tokenizer(500))
        assert str(info.value).startswith(f"data record '{path}' is damaged")
