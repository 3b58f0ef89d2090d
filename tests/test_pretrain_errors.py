"""Bad input to `python -m pretrain` exits non-zero with one `error:` line naming the field or
file, the rule and the value, and leaves every file that existed before untouched."""

import hashlib
import shutil
from pathlib import Path

import pytest

from tests.pretrain_fixtures import cli, make_corpus, train_args


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    root = tmp_path_factory.mktemp("errors")
    data = make_corpus(root / "data")
    cli("train-tokenizer", data["corpus"], "--output", str(root / "data" / "small"),
        "--vocab-size", "400")
    run = root / "finished"
    cli(*train_args(data, run, "--run.steps=3", "--run.eval_iters=0"))
    corrupt = root / "corrupt-run"
    shutil.copytree(run, corrupt)
    shard = next((corrupt / "checkpoints" / "step_00000003").glob("*.distcp"))
    shard.write_bytes(b"\x00garbage" * 64)
    (root / "bad.toml").write_text("[model\nnum_layers = 2\n")
    (root / "empty.txt").write_text("")
    (root / "notext.jsonl").write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    (root / "garbage.model").write_bytes(b"not a sentencepiece model")
    (root / "a-file").write_text("x")
    lines = Path(data["corpus"]).read_text().splitlines()[:20]
    (root / "part.jsonl").write_text("\n".join(lines) + "\n")
    cli("prepare-data", str(root / "part.jsonl"), "--tokenizer", data["tokenizer"],
        "--output", str(root / "data" / "part"))
    return {"root": root, "data": data, "run": run, "corrupt": corrupt}


def _train(c, *extra):
    return train_args(c["data"], c["root"] / "new-run", *extra)


CASES = {
    "unknown key": (lambda c: _train(c, "--model.foo=1"), ["model.foo", "unknown"]),
    "wrong type": (lambda c: _train(c, "--optim.lr=fast"), ["optim.lr", "'fast'", "float"]),
    "unknown section": (lambda c: _train(c, "--bogus.x=1"), ["[bogus]"]),
    "override syntax": (lambda c: _train(c, "--model.num_layers"), ["--model.num_layers"]),
    "missing config": (lambda c: ["train", "--config", str(c["root"] / "nope.toml")],
                       ["nope.toml", "does not exist"]),
    "invalid toml": (lambda c: ["train", "--config", str(c["root"] / "bad.toml")],
                     ["bad.toml", "not valid TOML"]),
    "missing data": (lambda c: _train(c, '--data.prefixes=["/nonexistent/corpus"]'),
                     ["/nonexistent/corpus.bin", "does not exist"]),
    "empty data file": (lambda c: ["prepare-data", str(c["root"] / "empty.txt"), "--tokenizer",
                                   c["data"]["tokenizer"], "--output", str(c["root"] / "e")],
                        ["empty.txt", "is empty"]),
    "jsonl without text": (lambda c: ["prepare-data", str(c["root"] / "notext.jsonl"),
                                      "--tokenizer", c["data"]["tokenizer"],
                                      "--output", str(c["root"] / "n")],
                           ["notext.jsonl", "line 2", "\"text\""]),
    "data ids beyond vocabulary": (
        lambda c: _train(c, f"--data.tokenizer={c['root'] / 'data' / 'small.model'}"),
        [c_ for c_ in ("has token id", ">= tokenizer vocab_size 400")]),
    "model vocab below tokenizer": (lambda c: _train(c, "--model.vocab_size=256"),
                                    ["model.vocab_size (256)", "(512"]),
    "sequence longer than model": (lambda c: _train(c, "--data.seq_length=64"),
                                   ["data.seq_length (64)", "model.seq_length (32)"]),
    "global batch vs micro x dp": (lambda c: _train(c, "--data.global_batch_size=10"),
                                   ["data.global_batch_size (10)", "(4 x 1)"]),
    "layout vs world size": (lambda c: _train(c, "--parallel.pp=2"),
                             ["world size (1)", "parallel.tp x parallel.pp (2)"]),
    "missing tokenizer": (lambda c: _train(c, "--data.tokenizer=/nonexistent/tok.model"),
                          ["/nonexistent/tok.model", "does not exist"]),
    "corrupt tokenizer": (lambda c: _train(c, f"--data.tokenizer={c['root'] / 'garbage.model'}"),
                          ["garbage.model", "not a sentencepiece model"]),
    "unwritable run folder": (lambda c: _train(c, f"--run.dir={c['root'] / 'a-file' / 'run'}"),
                              ["a-file/run", "not writable"]),
    "missing checkpoint folder": (
        lambda c: ["eval", "--config", str(c["run"] / "config.toml"),
                   "--checkpoint", str(c["root"] / "no-such-ckpt")],
        ["no-such-ckpt", "does not exist"]),
    "corrupt checkpoint": (
        lambda c: train_args(c["data"], c["corrupt"], "--run.steps=5", "--run.eval_iters=0"),
        ["step_00000003", "could not be loaded"]),
    "missing init checkpoint": (lambda c: _train(c, "--run.init_from=/nonexistent/ckpt"),
                                ["/nonexistent/ckpt", "does not exist"]),
    "existing prepare output": (
        lambda c: ["prepare-data", c["data"]["corpus"], "--tokenizer", c["data"]["tokenizer"],
                   "--output", c["data"]["prefix"]],
        ["topics.bin", "already exists"]),
    "existing tokenizer output": (
        lambda c: ["train-tokenizer", c["data"]["corpus"], "--output",
                   c["data"]["tokenizer"][:-len(".model")], "--vocab-size", "512"],
        ["tok.model", "already exists"]),
    "unknown command": (lambda c: ["fly"], ["command line", "fly"]),
    "negative peak TFLOP/s": (lambda c: _train(c, "--logging.peak_tflops=-989"),
                              ["logging.peak_tflops (-989.0)", ">= 0"]),
    "no validation share": (lambda c: _train(c, "--data.split=100,0,0"),
                            ["data.split ('100,0,0')", "valid split", "topics'"]),
    # 2% of 20 documents rounds to none: megatron would loop forever looking for tokens.
    "blended prefix too small to split": (
        lambda c: _train(c, f'--data.prefixes=["{c["data"]["prefix"]}", '
                            f'"{c["root"] / "data" / "part"}"]'),
        ["data.split ('98,2,0')", "valid split", "part'", "20 documents"]),
}


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_damages_nothing(ctx, case):
    make_args, fragments = CASES[case]
    before = _snapshot(ctx["root"])
    done = cli(*make_args(ctx), check=False)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), done.stderr[-2000:]
    for fragment in fragments:
        assert fragment in last, (fragment, last)
    after = _snapshot(ctx["root"])
    changed = [p for p, digest in before.items() if after.get(p) != digest]
    assert not changed, changed
