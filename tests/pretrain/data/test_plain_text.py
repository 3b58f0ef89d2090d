"""Plain-text inputs as a user gives them to ``prepare-data``: a source file is one document
(a blank line inside a function ends nothing), a ``.txt`` file is cut at blank lines, either
can be chosen with ``--plain-text``, and the summary says how the files were read. A JSON
line without the text field names the keys it has."""

import json

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from tests.pretrain_fixtures import cli

pytestmark = pytest.mark.slow  # each prepares data through the CLI

CODE = '''import os


def walk(top):
    """Every file under top."""

    for folder, _, names in os.walk(top):

        yield from (os.path.join(folder, n) for n in names)
'''
BOOK = "In the beginning.\n\nAnd the earth was without form.\n\nAnd God said.\n"


@pytest.fixture
def inputs(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "walk.py").write_text(CODE)
    (folder / "util.py").write_text("def one():\n    return 1\n\n\ndef two():\n    return 2\n")
    (folder / "book.txt").write_text(BOOK)
    return folder


def _prepare(data, inputs, out, *names, extra=()):
    done = cli("prepare-data", *(str(inputs / n) for n in names), "--tokenizer",
               data["tokenizer"], "--output", str(out), *extra)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _texts(data, prefix) -> list[str]:
    """The documents of ``prefix`` decoded, each without its end-of-document token."""
    from pretrain.data.tokenizer import open_tokenizer

    tokenizer = open_tokenizer(data["tokenizer"])
    dataset = IndexedDataset(str(prefix))
    return [tokenizer.decode([int(t) for t in np.asarray(dataset[i])[:-1]])
            for i in range(len(dataset))]


def test_source_files_are_one_document_each_and_the_summary_says_so(data, inputs, tmp_path):
    summary = _prepare(data, inputs, tmp_path / "code", "walk.py", "util.py")
    assert summary["documents"] == 2
    assert summary["plain_text"] == {"one_document_each": 2, "cut_at_blank_lines": 0}
    texts = _texts(data, tmp_path / "code")
    assert "\n\n" in texts[0] and texts[0].startswith("import os") and "yield from" in texts[0]


def test_txt_files_are_cut_at_blank_lines_and_either_rule_can_be_chosen(data, inputs,
                                                                        tmp_path):
    summary = _prepare(data, inputs, tmp_path / "mixed", "book.txt", "util.py")
    assert summary["documents"] == 3 + 1
    assert summary["plain_text"] == {"one_document_each": 1, "cut_at_blank_lines": 1}
    whole = _prepare(data, inputs, tmp_path / "whole", "book.txt", extra=["--plain-text",
                                                                          "file"])
    assert whole["documents"] == 1
    cut = _prepare(data, inputs, tmp_path / "cut", "util.py", extra=["--plain-text",
                                                                     "paragraphs"])
    assert cut["documents"] == 2


def test_a_wrong_plain_text_choice_and_a_missing_field_are_one_line(data, inputs, tmp_path):
    done = cli("prepare-data", str(inputs / "util.py"), "--tokenizer", data["tokenizer"],
               "--output", str(tmp_path / "out"), "--plain-text", "lines", check=False)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == (
        "error: --plain-text ('lines') must be one of: auto, file, paragraphs")
    corpus = tmp_path / "code.jsonl"
    corpus.write_text(json.dumps({"path": "a.py", "content": CODE}) + "\n")
    done = cli("prepare-data", str(corpus), "--tokenizer", data["tokenizer"], "--output",
               str(tmp_path / "out"), check=False)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: data file '{corpus}' line 1 has no \"text\" field (its keys: \"path\", "
        "\"content\"); --text-field names the field that holds the text")
    assert not list(tmp_path.glob("out*"))


def test_a_training_start_says_how_many_documents_are_longer_than_a_sequence(data, tmp_path):
    """Documents longer than model.seq_length are split across samples and trained on; the
    start says how many there are (counted here from the index itself)."""
    from tests.pretrain_fixtures import train_args

    dataset = IndexedDataset(data["prefix"])  # held: its arrays are views of its memory map
    lengths = np.array(dataset.sequence_lengths)
    longer = int((lengths > 32).sum())  # TINY's sequence length
    assert longer > 0
    done = cli(*train_args(data, tmp_path / "run", "--run.steps=3"))
    assert (f"data: {data['prefix']}: {longer:,} of {len(lengths):,} documents are longer "
            "than model.seq_length (32 tokens): packing splits them across sequences and "
            "every part is trained on, each part after the first without the document's "
            "beginning in its context") in done.stderr
