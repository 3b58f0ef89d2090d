"""Hugging Face tokenizer files (GPT-NeoX's format) through prepare-data, train, eval, generate.

A byte-level BPE ``tokenizer.json`` is trained here with the ``tokenizers`` library (offline),
with GPT-NeoX's special tokens; the framework must tokenise exactly as that library does (EOD
after each document), and train, evaluate and sample with it end to end.
"""

import json

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pretrain.data.documents import iter_documents
from pretrain.data.tokenizer import open_tokenizer
from runtime.errors import DataError
from tests.pretrain_fixtures import cli, train_args

SPECIALS = ["<|endoftext|>", "<|padding|>"]


def byte_level_bpe(corpus: str, vocab_size: int = 500, specials=SPECIALS) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(iter_documents(corpus), trainer)
    return tok


@pytest.fixture(scope="module")
def hf(data, tmp_path_factory):
    """A tokenizer folder (tokenizer.json + tokenizer_config.json) and its dataset."""
    folder = tmp_path_factory.mktemp("hf")
    byte_level_bpe(data["corpus"]).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "pad_token": "<|padding|>"}))
    cli("prepare-data", data["corpus"], "--tokenizer", str(folder),
        "--output", str(folder / "corpus"))
    return {"folder": folder, "prefix": str(folder / "corpus")}


def test_prepared_tokens_equal_the_tokenizers_library(data, hf):
    library = Tokenizer.from_file(str(hf["folder"] / "tokenizer.json"))
    eod = library.token_to_id("<|endoftext|>")
    dataset = IndexedDataset(hf["prefix"])
    documents = list(iter_documents(data["corpus"]))
    assert len(dataset) == len(documents)
    for i in (0, 1, len(documents) // 2, len(documents) - 1):
        want = library.encode(documents[i], add_special_tokens=False).ids + [eod]
        assert np.array_equal(dataset[i], np.array(want)), i
    ours = open_tokenizer(str(hf["folder"]))
    assert (ours.eod, ours.pad) == (eod, library.token_to_id("<|padding|>"))
    assert ours.decode(ours.encode(documents[3])) == documents[3]  # byte-level: lossless


def test_trains_evaluates_and_generates(data, hf, tmp_path):
    run = tmp_path / "run"
    overrides = (f"--data.tokenizer={hf['folder']}", f"--data.prefixes={hf['prefix']}",
                 "--run.steps=4", "--run.eval_interval=100")
    cli(*train_args(data, run, *overrides))
    assert f'tokenizer = "{hf["folder"]}"' in (run / "config.toml").read_text()
    [line] = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()
              if "val_loss" in x][-1:]
    result = json.loads(cli("eval", "--checkpoint", str(run / "checkpoints")).stdout
                        .splitlines()[-1])
    assert result["val_loss"] == pytest.approx(line["val_loss"], rel=1e-6)
    [sample] = [json.loads(x) for x in cli("generate", "--checkpoint", str(run / "checkpoints"),
                                           "--prompt", "def", "--max-tokens=5").stdout
                .splitlines()]
    assert sample["tokens"] >= 1


def test_a_folder_without_tokenizer_json_is_one_line(data, tmp_path):
    done = cli("prepare-data", data["corpus"], "--tokenizer", str(tmp_path),
               "--output", str(tmp_path / "x"), check=False)
    assert done.returncode == 2 and "is a folder without a tokenizer.json" in done.stderr
    assert done.stderr.count("\n") == 1, done.stderr


def test_a_tokenizer_without_an_end_of_document_token_is_refused(data, tmp_path):
    path = tmp_path / "tokenizer.json"
    byte_level_bpe(data["corpus"], specials=["<unk>"]).save(str(path))
    with pytest.raises(DataError, match="has no end-of-document token"):
        open_tokenizer(str(path))
    path.write_text("{not json")
    with pytest.raises(DataError, match="is not a Hugging Face tokenizer.json"):
        open_tokenizer(str(path))
