"""A blend of many prefixes: one bad file among a hundred, data of another tokenizer, weights
that do not sum sensibly, each refused in one line naming it before any step; and the epochs
of each prefix the run reads, with a warning above one (for training only: eval reads none)."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from pretrain.config import load_config
from pretrain.data import record
from pretrain.data.checks import check_data
from runtime.errors import UserError
from tests.pretrain.data.datasets import megatron_dataset, stub_tokenizer
from tests.pretrain_fixtures import REPO, TINY

PREFIXES = 100
DOCUMENTS, LENGTH = 20, 10  # per prefix: 200 tokens, half of them in the training split
VOCAB = 512


@pytest.fixture(scope="module")
def blend(tmp_path_factory) -> list[str]:
    """100 prefixes as Megatron-LM writes them, checked once so each has its record."""
    folder = tmp_path_factory.mktemp("blend")
    rng = np.random.default_rng(0)
    prefixes = []
    for i in range(PREFIXES):
        prefix = folder / f"part{i:03d}"
        megatron_dataset(prefix, [[rng.integers(4, VOCAB, LENGTH).tolist()]
                                  for _ in range(DOCUMENTS)], np.uint16)
        prefixes.append(str(prefix))
    return prefixes


def _config(prefixes: list[str], folder, *extra: str):
    return load_config(str(REPO / "configs" / "demo-cpu.toml"), [
        *TINY, f"--data.prefixes={','.join(prefixes)}", f"--run.dir={folder / 'run'}",
        "--data.split=50,50,0", "--data.valid_samples=8", "--run.steps=4", *extra])


def _one_line(call, *args) -> str:
    with pytest.raises(UserError) as info:
        call(*args)
    assert "\n" not in str(info.value)
    return str(info.value)


def _moved(path: str, tmp_path):
    """``path`` moved aside for one test; put back by the caller's finally."""
    aside = tmp_path / os.path.basename(path)
    os.replace(path, aside)
    return aside


def test_a_missing_idx_among_a_hundred_prefixes_is_named_before_any_scan(blend, tmp_path,
                                                                       monkeypatch):
    check_data(_config(blend, tmp_path), stub_tokenizer(VOCAB))  # records made
    monkeypatch.setattr(record, "scan", None)  # a scan would fail: none happens
    aside = _moved(blend[57] + ".idx", tmp_path)
    try:
        message = _one_line(check_data, _config(blend, tmp_path), stub_tokenizer(VOCAB))
    finally:
        os.replace(aside, blend[57] + ".idx")
    assert message == f"data file '{blend[57]}.idx' does not exist"


def test_a_truncated_shard_is_named(blend, tmp_path):
    path = blend[3] + ".bin"
    whole = open(path, "rb").read()
    try:
        open(path, "wb").write(whole[:-6])
        message = _one_line(check_data, _config(blend, tmp_path), stub_tokenizer(VOCAB))
    finally:
        open(path, "wb").write(whole)
    assert message.startswith(f"data file '{path}' has {len(whole) - 6} bytes")


def test_a_shard_of_another_tokenizer_is_named(blend, tmp_path):
    prefix = str(tmp_path / "other")
    megatron_dataset(tmp_path / "other", [[[5] * LENGTH]] * DOCUMENTS, np.uint16)
    record.write(prefix, record.make(prefix, DOCUMENTS * LENGTH, DOCUMENTS, (5, 5),
                                     stub_tokenizer(4096, "small")))
    message = _one_line(check_data, _config([*blend[:10], prefix], tmp_path),
                        stub_tokenizer(VOCAB, "big"))
    assert message.startswith(f"data prefix '{prefix}' was made with another tokenizer: "
                              "'small.model'")
    assert "'big.model'" in message


@pytest.mark.parametrize("weights, named", [
    ("1,inf", "data.weights entry for '{1}' (inf) must be a finite number > 0"),
    ("1e308,1e308", "data.weights sum to inf"),
])
def test_weights_that_do_not_sum_sensibly_are_refused(blend, tmp_path, weights, named):
    message = _one_line(check_data, _config(blend[:2], tmp_path, f"--data.weights={weights}"),
                        stub_tokenizer(VOCAB))
    assert named.format(*blend) in message


def test_the_epochs_of_each_prefix_are_said_and_over_one_warned(blend, tmp_path, caplog):
    # 4 steps x 8 samples x 8 tokens = 256 tokens; the first prefix has 3/4 of them and a
    # training split of 100 tokens: 1.92 epochs; the second 64 / 100 = 0.64.
    caplog.set_level(logging.INFO, logger="pretrain")
    check_data(_config(blend[:2], tmp_path, "--data.weights=3,1", "--model.seq_length=8"),
               stub_tokenizer(VOCAB))
    lines = [r.getMessage() for r in caplog.records]
    assert f"data: {blend[0]}: 100 training tokens; the run reads 1.92 epochs of them" in lines
    assert f"data: {blend[1]}: 100 training tokens; the run reads 0.64 epochs of them" in lines
    assert (f"the run reads more than one epoch of 1 prefix, so its samples repeat: "
            f"{blend[0]} 1.92; from the second pass on the training loss also falls by "
            "memorising them, and only the validation loss (documents the run never trains "
            "on) shows what the model learned beyond them: expect it to stop falling, then "
            "rise") in lines


def test_eval_hears_nothing_of_the_training_epochs(blend, tmp_path, caplog):
    """eval checks the same data but reads no training sample: no epochs line, no warning
    about samples repeating or a weight's share of the training samples."""
    caplog.set_level(logging.INFO, logger="pretrain")
    check_data(_config(blend[:2], tmp_path, "--data.weights=3,1e-9", "--model.seq_length=8"),
               stub_tokenizer(VOCAB), training=False)
    said = [r.getMessage() for r in caplog.records]
    assert not [line for line in said if "epoch" in line or "training samples" in line], said


def test_a_large_blend_is_summarised_in_one_line(blend, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="pretrain")
    check_data(_config(blend, tmp_path, "--run.steps=3"), stub_tokenizer(VOCAB))
    epochs = [r.getMessage() for r in caplog.records if "epochs of each" in r.getMessage()]
    # 3 x 8 x 32 = 768 tokens over 100 equal prefixes of 100 training tokens: 0.08 each
    assert epochs == [f"data: 100 prefixes, 10.00K training tokens; the run reads 0.08 "
                      f"({blend[0]}) to 0.08 ({blend[0]}) epochs of each"]
