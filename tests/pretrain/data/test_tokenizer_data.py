"""Tokenizer training, data preparation and Megatron indexed-dataset compatibility (CPU, fast).

The corpus is a few hundred generated sentences, so sentencepiece trains in well under a second;
the files megatron-core's own builder writes stand in for Megatron-LM preprocessed data.
"""

from __future__ import annotations

import json
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset
from megatron.core.datasets.utils import Split

from pretrain.data import prepare
from pretrain.data.checks import check_dataset
from pretrain.data.documents import Skipped, iter_documents
from pretrain.data.prepare import prepare_data
from pretrain.data.tokenizer import (
    BOS,
    EOS,
    PAD,
    UNK,
    SentencePieceTokenizer,
    Tokenizer,
    open_tokenizer,
    train_tokenizer,
)
from pretrain.unsharded.generate import completion
from runtime.errors import UserError
from tests.pretrain.data.datasets import megatron_dataset, stub_tokenizer

VOCAB = 400
TRICKY = [
    "",
    "hello world",
    "line one\nline two\n\n\nafter blank lines\n",
    "  two  spaces   three   ",
    "\ttab\t\tstart and end\t",
    "naïve café — 漢字 😀",
    " \n \n ",
    "windows\r\nline\rends",
    "no\u00a0break and zero\u200bwidth",
    "ﬁ ligature, Å vs Å (NFC vs NFD)",
    "control \x00\x01\x7f chars",
    "digits 1234567890 and 3.14159",
]


def _corpus(rng: random.Random, paragraphs: int = 120) -> list[str]:
    """English-like paragraphs (1-4 sentences) from a seeded random word list."""
    syllables = ["ka", "lo", "mi", "ther", "an", "st", "ing", "ed", "or", "qu", "ve", "tion"]
    words = ["the", "a", "of", "and", "to", "in", "is", "was", "for", "on"]
    words += ["".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(150)]
    documents = []
    for _ in range(paragraphs):
        sentences = []
        for _ in range(rng.randint(1, 4)):
            sentence = " ".join(rng.choices(words, k=rng.randint(3, 14)))
            if rng.random() < 0.2:
                sentence += f" {rng.randint(0, 99999)}"
            sentences.append(sentence.capitalize() + rng.choice(".!?;,"))
        documents.append((" " if rng.random() < 0.5 else "\n").join(sentences))
    return documents


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, list[str]]:
    folder = tmp_path_factory.mktemp("corpus")
    documents = _corpus(random.Random(1234))
    path = folder / "corpus.txt"
    path.write_text("\n\n".join(documents) + "\n", encoding="utf-8")
    return path, documents


@pytest.fixture(scope="module")
def tokenizers(corpus, tmp_path_factory) -> dict[str, Tokenizer]:
    folder = tmp_path_factory.mktemp("tokenizers")
    return {kind: open_tokenizer(train_tokenizer([str(corpus[0])], str(folder / kind), VOCAB, kind))
            for kind in ("bpe", "unigram")}


def _raises(match: str, call, *args, **kwargs) -> str:
    """The user-error message (config or data), checked to be one line containing ``match``."""
    with pytest.raises(UserError) as info:
        call(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message, message
    assert match in message, message
    return message


# --- tokenizer ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["bpe", "unigram"])
def test_round_trip_is_exact(tokenizers, kind):
    tok = tokenizers[kind]
    assert (UNK, BOS, EOS, PAD) == (0, 1, 2, 3)
    assert (tok.eod, tok.eos, tok.bos, tok.pad) == (EOS, EOS, BOS, PAD)
    assert 261 < tok.vocab_size <= VOCAB
    for text in TRICKY:
        ids = tok.encode(text)
        assert tok.decode(ids) == text, (kind, text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.eod not in ids and tok.bos not in ids  # no specials added by encode
    pieces = [tok.processor.id_to_piece(i) for i in tok.encode("a\nb")]
    assert "\n" in pieces  # one piece of its own, not byte fallback
    assert tok.decode(np.array(tok.encode("numpy ids"))) == "numpy ids"


def test_tokenizer_pickles_and_identifies_by_content(tokenizers, tmp_path):
    tok = tokenizers["bpe"]
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.encode("some text") == tok.encode("some text")
    moved = tmp_path / "moved.model"
    moved.write_bytes(Path(tok.path).read_bytes())
    assert open_tokenizer(str(moved)).unique_identifiers == tok.unique_identifiers
    assert tokenizers["unigram"].unique_identifiers != tok.unique_identifiers
    json.dumps(tok.unique_identifiers)  # megatron hashes it as JSON


def test_long_lines_are_learnt(corpus, tmp_path):
    """sentencepiece silently drops training lines over max_sentence_length bytes; ours are cut
    to fit, so text found only on a long line still shapes the vocabulary."""
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"text": " ".join(["Жук"] * 3000)}) + "\n", encoding="utf-8")
    tok = open_tokenizer(train_tokenizer([str(corpus[0]), str(data)], str(tmp_path / "t"), VOCAB))
    assert [tok.processor.id_to_piece(i) for i in tok.encode("Жук")] == ["▁Жук"]


def test_iter_documents(tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_bytes("\ufefffirst  para\nsame para\r\n \t\nsecond\n\n\n\nthird\n".encode())
    assert list(iter_documents(str(txt))) == ["first  para\nsame para", "second", "third"]
    jsonl = tmp_path / "b.jsonl"
    lines = [{"text": "one\n two"}, {"text": ""}, {"text": "three", "id": 3}]
    jsonl.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n", encoding="utf-8")
    assert list(iter_documents(str(jsonl))) == ["one\n two", "three"]
    skipped = Skipped()
    assert list(iter_documents(str(jsonl), skipped=skipped)) == ["one\n two", "three"]
    assert skipped.empty == 2  # the empty text and the blank line at the end


def test_prepare_data_counts_the_empty_documents_it_skips(tokenizers, tmp_path):
    """Blank lines of a JSON-lines file and empty texts are skipped, as before, and now counted
    in the summary (the line prepare-data prints) and in the dataset's record."""
    jsonl = tmp_path / "gaps.jsonl"
    lines = ["", json.dumps({"text": "first"}), "  ", json.dumps({"text": ""}),
             json.dumps({"text": "second"}), "\r", ""]
    jsonl.write_text("\n".join(lines) + "\n", encoding="utf-8")
    text = tmp_path / "paragraphs.txt"  # blank lines between paragraphs separate, not skip
    text.write_text("third\n\n\nfourth\n", encoding="utf-8")
    summary = prepare_data([str(jsonl), str(text)], tokenizers["bpe"].path,
                           str(tmp_path / "gaps"))
    assert (summary["documents"], summary["empty_skipped"]) == (4, 5)
    made = json.loads((tmp_path / "gaps.record.json").read_text())
    assert (made["documents"], made["empty_skipped"]) == (4, 5)


# --- prepare-data and megatron compatibility ----------------------------------------------


@pytest.mark.slow
def test_prepare_data_reads_back(tokenizers, corpus, tmp_path, monkeypatch):
    path, documents = corpus
    tok = tokenizers["bpe"]
    extra = tmp_path / "extra.jsonl"
    extra.write_text(json.dumps({"text": "naïve café\n\tend"}) + "\n", encoding="utf-8")
    inputs, documents = [str(path), str(extra)], documents + ["naïve café\n\tend"]
    monkeypatch.setattr(prepare, "CHUNK_DOCUMENTS", 7)  # many chunks in flight
    one = prepare_data(inputs, tok.path, str(tmp_path / "w1"), workers=1)
    two = prepare_data(inputs, tok.path, str(tmp_path / "w2"), workers=2)
    expected = [tok.encode(doc) + [tok.eod] for doc in documents]
    assert one == {"documents": len(documents), "tokens": sum(map(len, expected)),
                   "dtype": "uint16", "prefix": str(tmp_path / "w1"), "empty_skipped": 0,
                   "plain_text": {"cut_at_blank_lines": 1, "one_document_each": 0}}
    assert two["tokens"] == one["tokens"]
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"w1{suffix}").read_bytes() == (tmp_path / f"w2{suffix}").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "extra.jsonl", "w1.bin", "w1.idx", "w1.record.json", "w2.bin", "w2.idx",
        "w2.record.json"]  # no temporary files left
    dataset = IndexedDataset(str(tmp_path / "w1"))
    assert dataset.index.dtype == DType.optimal_dtype(tok.vocab_size) == np.uint16
    assert len(dataset) == len(dataset.index.document_indices) - 1 == len(documents)
    assert [dataset[i].tolist() for i in range(len(dataset))] == expected
    assert check_dataset(str(tmp_path / "w1"), tok).documents == len(documents)


def test_gpt_dataset_accepts_tokenizer(tokenizers, corpus, tmp_path):
    tok = tokenizers["unigram"]
    prefix = str(tmp_path / "data")
    prepare_data([str(corpus[0])], tok.path, prefix)
    config = GPTDatasetConfig(
        random_seed=1, sequence_length=32, blend=None, blend_per_split=[([prefix], None)] * 3,
        split=None, path_to_cache=str(tmp_path / "cache"), tokenizer=tok,
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False, mid_level_dataset_surplus=0.05)
    indexed = IndexedDataset(prefix)
    documents = np.arange(len(indexed), dtype=np.int32)
    dataset = GPTDataset(indexed, prefix, documents, 8, Split.train, config)
    sample = dataset[0]
    assert sample["tokens"].shape == sample["labels"].shape == (32,)
    assert int(sample["tokens"].max()) < tok.vocab_size
    assert dataset._pad_token_id == tok.pad  # megatron kept our pad: distinct from eod
    assert tok.unique_identifiers["model_sha256"] in dataset.unique_description


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_builder_files_pass_check(tmp_path, dtype):
    rng = np.random.default_rng(0)
    vocab = 70_000 if dtype == np.int32 else 500
    documents = [[rng.integers(0, vocab, rng.integers(1, 20)).tolist()
                  for _ in range(rng.integers(1, 4))] for _ in range(25)]
    prefix = tmp_path / "megatron"
    megatron_dataset(prefix, documents, dtype)
    assert check_dataset(str(prefix), stub_tokenizer(vocab)).documents == len(documents)
    dataset = IndexedDataset(str(prefix))
    assert dataset.index.dtype == dtype
    sequences = [seq for doc in documents for seq in doc]
    assert [dataset[i].tolist() for i in range(len(dataset))] == sequences


def test_token_dtype_follows_megatron(tokenizers, corpus, tmp_path, monkeypatch):
    assert DType.optimal_dtype(VOCAB) == DType.optimal_dtype(65_499) == np.uint16
    assert DType.optimal_dtype(65_500) == DType.optimal_dtype(128_256) == np.int32
    tok = tokenizers["bpe"]
    monkeypatch.setattr(SentencePieceTokenizer, "vocab_size", property(lambda self: 128_256))
    summary = prepare_data([str(corpus[0])], tok.path, str(tmp_path / "big"))
    dataset = IndexedDataset(str(tmp_path / "big"))
    assert summary["dtype"] == "int32" and dataset.index.dtype == np.int32
    assert dataset[0].tolist() == tok.encode(corpus[1][0]) + [tok.eod]


# --- user mistakes -------------------------------------------------------------------------


def test_bad_inputs(tmp_path, tokenizers):
    model, prefix = tokenizers["bpe"].path, str(tmp_path / "out")
    missing = str(tmp_path / "missing.txt")
    _raises(f"data file '{missing}' does not exist", train_tokenizer, [missing], prefix, VOCAB)
    _raises(f"data file '{missing}' does not exist", prepare_data, [missing], model, prefix)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    _raises(f"data file '{empty}' is empty", prepare_data, [str(empty)], model, prefix)
    _raises(f"data file '{empty}' is empty", train_tokenizer, [str(empty)], prefix, VOCAB)
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n\t\n")
    _raises(f"data file '{blank}' has no documents", prepare_data, [str(blank)], model, prefix)
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_text('{"text": "fine"}\n{"title": "no text"}\n')
    expected = (f"data file '{jsonl}' line 2 has no \"text\" field (its keys: \"title\"); "
                "--text-field names the field that holds the text")
    _raises(expected, prepare_data, [str(jsonl)], model, prefix)
    _raises(expected, train_tokenizer, [str(jsonl)], prefix, VOCAB)  # raised inside spm
    binary = tmp_path / "latin1.txt"
    binary.write_bytes(b"fine\ncaf\xe9\n")
    _raises(f"data file '{binary}' line 2 is not UTF-8", prepare_data, [str(binary)], model,
            prefix)
    assert not any(p.name.startswith("out") for p in tmp_path.iterdir())


def test_bad_training_settings(tmp_path, corpus):
    data, prefix = [str(corpus[0])], str(tmp_path / "tok")
    _raises("tokenizer vocab_size (50) must be >= 261", train_tokenizer, data, prefix, 50)
    _raises("tokenizer vocab_size (270) must be >= ", train_tokenizer, data, prefix, 270)
    _raises("tokenizer model_type ('wordpiece')", train_tokenizer, data, prefix, VOCAB,
            "wordpiece")
    _raises("prepare-data workers (0) must be >= 1", prepare_data, data, "x.model", prefix, 0)
    assert list(tmp_path.iterdir()) == []


def test_existing_outputs_are_never_overwritten(tmp_path, corpus, tokenizers):
    data, model = [str(corpus[0])], tokenizers["bpe"].path
    cases = [("a", "tok.model", train_tokenizer, (data, str(tmp_path / "a" / "tok"), VOCAB)),
             ("b", "tok.vocab", train_tokenizer, (data, str(tmp_path / "b" / "tok"), VOCAB)),
             ("c", "set.bin", prepare_data, (data, model, str(tmp_path / "c" / "set"))),
             ("d", "set.idx", prepare_data, (data, model, str(tmp_path / "d" / "set")))]
    for folder, name, call, args in cases:
        existing = tmp_path / folder / name
        existing.parent.mkdir()
        existing.write_bytes(b"precious bytes")
        _raises(f"'{existing}' already exists", call, *args)
        assert existing.read_bytes() == b"precious bytes"
        assert list(existing.parent.iterdir()) == [existing]


def test_bad_tokenizer_model(tmp_path, corpus):
    missing = str(tmp_path / "none.model")
    _raises(f"tokenizer '{missing}' does not exist", open_tokenizer, missing)
    _raises(f"tokenizer '{missing}' does not exist", prepare_data, [str(corpus[0])], missing,
            str(tmp_path / "out"))
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(bytes(random.Random(0).randrange(256) for _ in range(300)))
    _raises(f"tokenizer '{garbage}' is not a sentencepiece model", open_tokenizer, str(garbage))


def test_bad_datasets(tmp_path):
    prefix = tmp_path / "data"
    megatron_dataset(prefix, [[[5, 499, 7]], [[1, 2]]], np.uint16)
    _raises(f"data prefix '{prefix}' has token id 499 >= tokenizer vocab_size 300",
            check_dataset, str(prefix), stub_tokenizer(300))
    assert check_dataset(str(prefix), stub_tokenizer(500)).documents == 2
    bin_bytes = (tmp_path / "data.bin").read_bytes()
    (tmp_path / "data.bin").write_bytes(bin_bytes[:-2])
    _raises(f"data file '{prefix}.bin' has 8 bytes but '{prefix}.idx' describes 10",
            check_dataset, str(prefix), stub_tokenizer(500))
    (tmp_path / "data.idx").write_bytes(b"not an index at all")
    _raises(f"data file '{prefix}.idx' is not a Megatron index (bad header)",
            check_dataset, str(prefix), stub_tokenizer(500))
    (tmp_path / "data.idx").unlink()
    _raises(f"data file '{prefix}.idx' does not exist", check_dataset, str(prefix),
            stub_tokenizer(500))
    _raises(f"data file '{tmp_path}/none.bin' does not exist", check_dataset,
            str(tmp_path / "none"), stub_tokenizer(500))


@pytest.mark.parametrize("kind", ["bpe", "unigram"])
def test_a_completion_keeps_the_space_it_starts_with(tokenizers, corpus, kind):
    """Whatever token a prompt ends at, prompt text + completion text = the whole text; the
    completion of a prompt ending before a word starts with that word's space."""
    tok = tokenizers[kind]
    text = corpus[1][0][:200]
    ids = tok.encode(text)
    for cut in range(1, len(ids)):
        head, tail = ids[:cut], ids[cut:]
        assert tok.decode(head) + completion(tok, head, tail) == tok.decode(ids), cut
    starts_with_space = [cut for cut in range(1, len(ids))
                         if completion(tok, ids[:cut], ids[cut:]).startswith(" ")]
    assert starts_with_space, text  # the case decoding the new ids alone got wrong


def test_prepare_data_writes_lines_not_a_bar_to_a_log(tokenizers, corpus, tmp_path, capfd,
                                                      monkeypatch):
    """stderr is no terminal here (as in a slurm log): no carriage returns, plain lines."""
    monkeypatch.setattr("pretrain.data.prepare.LOG_SECONDS", 0.0)
    capfd.readouterr()
    prepare_data([str(corpus[0])], tokenizers["bpe"].path, str(tmp_path / "logged"))
    err = capfd.readouterr().err
    assert "\r" not in err, err[:500]
    assert "tokenising:" in err and "documents" in err, err[:500]


def test_a_vocabulary_far_larger_than_the_tokenizers_is_said(data, caplog):
    """32,000 rows for a 512-piece tokenizer: the start says how many rows no token reads and
    the setting that fits; a vocabulary within the padding multiple says nothing."""
    from pretrain.build import tokenizer_for
    from pretrain.config import load_config
    from tests.pretrain_fixtures import REPO

    def said(vocab: int) -> list[str]:
        caplog.clear()
        config = load_config(str(REPO / "configs" / "demo-cpu.toml"),
                             [f"--data.tokenizer={data['tokenizer']}",
                              f"--model.vocab_size={vocab}"])
        with caplog.at_level("WARNING", logger="pretrain"):
            tokenizer_for(config)
        return caplog.messages

    assert said(32000) == [
        f"model.vocab_size (32,000) is 62.5 x the tokenizer's vocabulary (512, "
        f"{data['tokenizer']}): 31,488 embedding rows no token reads (128 parameters each); "
        "set model.vocab_size=512"]
    assert said(600) == []
