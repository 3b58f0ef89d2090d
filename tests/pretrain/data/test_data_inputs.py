"""prepare-data from Hugging Face-style inputs: parquet, Arrow, jsonl.gz and a datasets
``save_to_disk`` folder give byte-identical .bin/.idx to the same text as JSON lines."""

import gzip
import json

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pretrain.data.documents import Reading, iter_documents
from pretrain.data.prepare import prepare_data
from runtime.errors import DataError
from tests.pretrain_fixtures import cli

FIELD = "content"  # not the default "text": every input below is read with --text-field


@pytest.fixture(scope="module")
def texts(data):
    return list(iter_documents(data["corpus"]))[:300]


@pytest.fixture(scope="module")
def inputs(texts, tmp_path_factory):
    """The same documents in every format, with an extra non-text column."""
    folder = tmp_path_factory.mktemp("inputs")
    rows = [{"id": i, FIELD: t} for i, t in enumerate(texts)]
    with (folder / "docs.jsonl").open("w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with gzip.open(folder / "docs.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, folder / "docs.parquet", row_group_size=64)
    with pa.ipc.new_stream(str(folder / "docs.arrow"), table.schema) as writer:
        for batch in table.to_batches(max_chunksize=50):
            writer.write_batch(batch)
    dataset = datasets.Dataset.from_list(rows)
    dataset.save_to_disk(str(folder / "saved"))
    datasets.DatasetDict({"train": dataset, "test": dataset}).save_to_disk(str(folder / "dict"))
    return folder


def prepared(source, tokenizer: str, out) -> tuple[bytes, bytes]:
    prepare_data([str(source)], tokenizer, str(out), reading=Reading(text_field=FIELD))
    return out.with_suffix(".bin").read_bytes(), out.with_suffix(".idx").read_bytes()


@pytest.mark.parametrize("name", ["docs.jsonl.gz", "docs.parquet", "docs.arrow", "saved"])
def test_same_bytes_as_jsonl(data, inputs, tmp_path, name):
    want = prepared(inputs / "docs.jsonl", data["tokenizer"], tmp_path / "reference")
    got = prepared(inputs / name, data["tokenizer"], tmp_path / "other")
    assert got == want
    assert len(want[0]) > 1000


def test_documents_in_order(inputs, texts):
    for name in ("docs.parquet", "docs.arrow", "saved", "docs.jsonl.gz"):
        assert list(iter_documents(str(inputs / name), Reading(FIELD))) == texts, name


@pytest.mark.parametrize("name,field,words", [
    ("docs.parquet", "body", ["has no column 'body'", "id, content"]),
    ("docs.arrow", "id", ["column 'id'", "holds int64, not text"]),
    ("saved", "id", ["column 'id'", "not text"]),
    ("dict", FIELD, ["holds the splits train, test", "dict/train"]),
    ("docs.jsonl.gz", "text", [f"line 1 has no \"text\" field (its keys: \"id\", \"{FIELD}\")",
                               "--text-field names the field that holds the text"]),
])
def test_bad_input_is_refused_before_any_work(data, inputs, tmp_path, name, field, words):
    with pytest.raises(DataError) as err:
        prepare_data([str(inputs / name)], data["tokenizer"], str(tmp_path / "out"),
                     reading=Reading(text_field=field))
    assert all(w in str(err.value) for w in words), err.value
    assert not list(tmp_path.iterdir())  # nothing written


def test_bad_input_is_one_line_from_the_cli(data, inputs, tmp_path):
    done = cli("prepare-data", str(inputs / "docs.parquet"), "--tokenizer", data["tokenizer"],
               "--output", str(tmp_path / "out"), "--text-field", "body", check=False)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "has no column 'body'" in done.stderr


def test_truncated_gzip_is_refused(data, inputs, tmp_path):
    broken = tmp_path / "broken.jsonl.gz"
    broken.write_bytes((inputs / "docs.jsonl.gz").read_bytes()[:200])
    with pytest.raises(DataError, match="not a complete gzip file"):
        list(iter_documents(str(broken), Reading(FIELD)))
