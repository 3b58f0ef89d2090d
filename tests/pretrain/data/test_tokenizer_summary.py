"""``train-tokenizer``'s summary: the vocabulary's make-up, the share of the input's characters
with a piece of their own (the rest fall back to bytes) and bytes per token, each checked
against the tokenizer's own encoding; a large input measured on a sample that says so; and the
command's stdout still the model's path alone."""

from __future__ import annotations

import contextlib
import logging
import warnings

import pytest

from pretrain.data import tokenizer_summary
from pretrain.data.documents import BY_DEFAULT
from pretrain.data.tokenizer import SentencePieceTokenizer, train_tokenizer
from pretrain.data.tokenizer_summary import summarize

WORDS = "the river ran past old stone walls and the mill wheel turned slowly all day"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("summary")
    corpus = folder / "corpus.txt"
    corpus.write_text("\n\n".join(f"{WORDS} {i}\nline two of {i}" for i in range(200)) + "\n")
    return corpus, train_tokenizer([str(corpus)], str(folder / "tok"), 300)


def test_the_numbers_are_the_tokenizers_own(trained, tmp_path):
    corpus, model = trained
    s = summarize(model, [str(corpus)], BY_DEFAULT)
    assert (s.pieces, s.bytes_pieces, s.special, s.fixed) == (300, 256, 4, 1)
    assert s.learnt == 39 and s.whole
    text = corpus.read_text()
    documents = text.strip("\n").split("\n\n")
    processor = SentencePieceTokenizer(model).processor
    assert s.characters == sum(map(len, documents)) and s.covered == s.characters
    assert s.tokens == sum(len(processor.encode(d)) for d in documents)
    assert s.utf8_bytes == sum(len(d.encode()) for d in documents)
    # characters the training input never had: each falls back to its UTF-8 bytes
    other = tmp_path / "other.txt"
    other.write_text("the mill é é é 漢\n")
    s = summarize(model, [str(other)], BY_DEFAULT)
    ids = processor.encode("the mill é é é 漢")
    fallback_bytes = sum(processor.is_byte(i) for i in ids)
    assert fallback_bytes == 3 * 2 + 3  # é is 2 bytes, 漢 3
    assert (s.characters, s.covered, s.missing) == (16, 12, ("é", "漢"))
    lines = s.lines()
    assert "75.00% of the characters have a piece of their own; the rest fall back to UTF-8 " \
           "byte pieces (most frequent: 'é', '漢')" in lines[1]


def test_a_large_input_is_measured_on_a_sample_that_says_so(trained, monkeypatch):
    corpus, model = trained
    monkeypatch.setattr(tokenizer_summary, "SAMPLE_CHARS", 1000)
    s = summarize(model, [str(corpus)], BY_DEFAULT)
    assert s.characters == 1000 and not s.whole
    assert "on the input (a sample: its first 1,000 characters): " in s.lines()[1]
    two = summarize(model, [str(corpus), str(corpus)], BY_DEFAULT)
    assert two.characters == 1000  # an equal share of each input


def test_the_command_prints_the_summary_and_only_the_path_on_stdout(trained, tmp_path,
                                                                     capsys):
    from pretrain.__main__ import main

    corpus, _ = trained
    root, ours = logging.getLogger(), logging.getLogger("pretrain")
    saved = root.handlers[:], root.level, ours.level
    try:
        with warnings.catch_warnings(), contextlib.chdir(tmp_path):
            code = main(["train-tokenizer", str(corpus), "--output", "tok", "--vocab-size",
                         "300"])
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        ours.setLevel(saved[2])
    out, err = capsys.readouterr()
    assert code == 0 and out == "tok.model\n"
    assert "[pretrain] tokenizer tok.model: 300 pieces: 39 learnt from the input, 256 byte " \
           "pieces, 4 special, 1 newline\n" in err
    assert "on the input (all of it, " in err and " bytes (" in err and "per token; 100.00% " \
        "of the characters have a piece of their own" in err
