"""A Hugging Face tokenizer that does not give back the text it encodes (the tokenizers
quicktour's BPE with a whitespace pre-tokenizer: ``def f(n):`` decodes as ``def f ( n ):``)
is refused by ``prepare-data`` in one line, is kept with ``--allow-lossy-tokenizer`` (the
record says so), and trains only on datasets prepared with that allowance."""

import json

import pytest

from tests.pretrain_fixtures import TINY, cli, train_losses

pytestmark = pytest.mark.slow  # prepares data and trains through the CLI

CODE = ["def f(n):\n    return n + 1\n", "class A:\n    x = [1, 2]  # two\n",
        "for i in range(3):\n\tprint(i, 'done')\n"] * 40


@pytest.fixture
def lossy(tmp_path):
    """The quicktour's tokenizer, trained on a small code corpus, and that corpus."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(CODE, trainers.BpeTrainer(
        special_tokens=["[UNK]", "</s>", "<pad>"], vocab_size=200))
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    corpus = tmp_path / "code.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in CODE))
    return {"tokenizer": str(path), "corpus": str(corpus)}


def test_a_lossy_tokenizer_is_refused_kept_when_allowed_and_trains_only_then(lossy, tmp_path):
    prefix = tmp_path / "code"
    refused = cli("prepare-data", lossy["corpus"], "--tokenizer", lossy["tokenizer"],
                  "--output", str(prefix), check=False)
    assert refused.returncode != 0
    assert refused.stderr.strip().splitlines()[-1] == (
        f"error: tokenizer '{lossy['tokenizer']}' does not give back the text it encodes: in "
        f"document 1 ('{lossy['corpus']}') 'def f(n):\\n    return n + 1\\n' decodes as "
        "'def f ( n ): return n + 1' (character 5); a model trained on its ids cannot write "
        "that text: use a lossless tokenizer (train-tokenizer's, or a byte-level BPE), or "
        "pass --allow-lossy-tokenizer to keep it (the dataset's record says so)")
    assert not list(tmp_path.glob("code.[bir]*"))  # no .bin, .idx, record
    kept = cli("prepare-data", lossy["corpus"], "--tokenizer", lossy["tokenizer"],
               "--output", str(prefix), "--allow-lossy-tokenizer")
    assert json.loads(kept.stdout.strip().splitlines()[-1])["lossy_tokenizer"] is True
    record = json.loads((tmp_path / "code.record.json").read_text())
    assert record["lossy_tokenizer"] is True
    train = ["train", "--config", "configs/demo-cpu.toml", *TINY, "--model.vocab_size=256",
             f"--data.prefixes=[\"{prefix}\"]", f"--data.tokenizer={lossy['tokenizer']}",
             "--run.steps=3", "--data.valid_samples=0", "--data.split=100,0,0"]
    done = cli(*train, f"--run.dir={tmp_path / 'run'}")
    assert "loses text" in done.stderr and sorted(train_losses(tmp_path / "run")) == [1, 2, 3]
    # a dataset whose record does not carry the allowance (prepared before it existed)
    del record["lossy_tokenizer"]
    (tmp_path / "code.record.json").write_text(json.dumps(record))
    refused = cli(*train, f"--run.dir={tmp_path / 'other'}", check=False)
    assert refused.returncode != 0
    assert refused.stderr.strip().splitlines()[-1].startswith(
        f"error: data.tokenizer '{lossy['tokenizer']}' does not give back the text it "
        "encodes (")
    assert f"and '{prefix}' was not prepared with --allow-lossy-tokenizer" in refused.stderr
    assert not (tmp_path / "other").exists()
