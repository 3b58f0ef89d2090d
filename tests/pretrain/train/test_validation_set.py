"""The validation set is fixed by data.valid_samples: the same samples, and so the same loss for
the same weights, whatever run.steps and run.eval_interval; a set the validation split cannot
hold without repeating a sample, or that is not whole batches, is refused in one line."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset

from model.builder import build_model, wrap_ddp
from pretrain.config import load_config
from pretrain.data.batches import _dataset_config, build_datasets
from pretrain.data.checks import check_data
from pretrain.data.tokenizer import open_tokenizer
from pretrain.train.evaluate import evaluate, require_validation
from runtime.errors import ConfigError, DataError
from tests.pretrain_fixtures import REPO, TINY

VALID = 16  # two batches of TINY's 8 sequences


def _config(data: dict, folder, *extra: str):
    """The CLI tests' tiny run (tests/pretrain_fixtures) with its own run folder and cache."""
    return load_config(str(REPO / "configs" / "demo-cpu.toml"), [
        *TINY, f"--data.prefixes={data['prefix']}", f"--data.tokenizer={data['tokenizer']}",
        f"--run.dir={folder}", f"--data.cache_dir={folder / 'cache'}",
        f"--data.valid_samples={VALID}", *extra])


# Short and long runs, rare and constant evaluation. Before the validation set was fixed, the
# first asked megatron for 64 validation samples (one pass over the split) and the second for
# 16,032 (hundreds of passes, shuffled together): other samples, another loss.
RUNS = {"short": ["--run.steps=4", "--run.eval_interval=2"],
        "long": ["--run.steps=1000", "--run.eval_interval=1"]}


@pytest.fixture(scope="module")
def valid_sets(single_rank, data, tmp_path_factory) -> dict:
    """Each run's config and validation dataset, built as training builds them."""
    tokenizer = open_tokenizer(data["tokenizer"])
    built = {}
    for name, extra in RUNS.items():
        config = _config(data, tmp_path_factory.mktemp(name), *extra)
        check_data(config, tokenizer)
        built[name] = (config, build_datasets(config, tokenizer)[1])
    return built


def test_validation_samples_do_not_depend_on_run_length(valid_sets):
    tokens = {name: torch.stack([valid[i]["tokens"] for i in range(VALID)])
              for name, (_, valid) in valid_sets.items()}
    assert torch.equal(tokens["short"], tokens["long"])
    assert len(valid_sets["short"][1]) == len(valid_sets["long"][1]) == VALID
    assert len({tuple(t.tolist()) for t in tokens["short"]}) == VALID  # no sample twice


def test_a_checkpoint_evaluates_to_the_same_loss_whatever_the_run_length(valid_sets):
    config, _ = valid_sets["short"]
    torch.manual_seed(0)
    chunks = wrap_ddp(build_model(config.model, config.parallel), config.parallel)
    results = {name: evaluate(run_config, chunks, valid)
               for name, (run_config, valid) in valid_sets.items()}
    assert results["short"] == results["long"]  # exactly: the same samples in the same batches
    assert results["short"]["val_samples"] == VALID
    assert 0 < results["short"]["val_loss"] < 20


def test_the_validation_split_must_hold_the_set_without_repeats(single_rank, data, tmp_path):
    """The sample count the check allows is megatron's own count for one pass over the
    validation split: the largest whole-batch set within it is accepted, the next refused."""
    tokenizer = open_tokenizer(data["tokenizer"])
    config = _config(data, tmp_path)
    one_pass = dataclasses.replace(_dataset_config(config, tokenizer),
                                   blend=([data["prefix"]], None))  # no size: one epoch
    _, valid, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [None, None, None], lambda: True, one_pass).build()
    available, batch = len(valid), config.data.global_batch_size
    fits = available // batch * batch
    check_data(_config(data, tmp_path, f"--data.valid_samples={fits}"), tokenizer)
    with pytest.raises(DataError) as refused:
        check_data(_config(data, tmp_path, f"--data.valid_samples={fits + batch}"), tokenizer)
    message = str(refused.value)
    assert "\n" not in message
    for fragment in (f"data.valid_samples ({fits + batch})", f"holds {available}",
                     f"'{data['prefix']}'"):
        assert fragment in message, (fragment, message)


@pytest.mark.parametrize("overrides, fragments", [
    (["--data.valid_samples=12"], ["data.valid_samples (12)", "multiple of",
                                   "data.global_batch_size (8)"]),
    (["--data.valid_samples=-8"], ["data.valid_samples (-8)", ">= 0"]),
    (["--run.eval_iters=4"], ["run.eval_iters (4)", "data.valid_samples"]),
], ids=["part-batch", "negative", "retired-eval-iters"])
def test_bad_validation_set_is_one_line(overrides, fragments):
    with pytest.raises(ConfigError) as bad:
        load_config(None, ["--data.global_batch_size=8", *overrides])
    assert "\n" not in str(bad.value)
    for fragment in fragments:
        assert fragment in str(bad.value), (fragment, str(bad.value))


def test_evaluation_needs_a_validation_set():
    """eval, and only eval: training without validation is fine, and so are the checkpoint's
    other commands (generate, export-hf, lm-eval), which load the config as eval does."""
    load_config(None, ["--data.valid_samples=0"])
    config = load_config(None, ["--data.valid_samples=0"], training=False)
    with pytest.raises(ConfigError) as info:
        require_validation(config)
    assert str(info.value) == (
        "eval has nothing to evaluate: data.valid_samples is 0 and data.valid_sets is empty; "
        "give --data.valid_samples=8 to score that many sequences of the validation split (any "
        "multiple of data.global_batch_size), or name a held-out dataset in data.valid_sets")
    config = load_config(None, ["--data.valid_samples=0", "--data.split=100,0,0"],
                         training=False)
    with pytest.raises(ConfigError) as info:
        require_validation(config)
    assert str(info.value) == (
        "eval has nothing to evaluate: data.valid_samples is 0 and data.valid_sets is empty; "
        "data.split ('100,0,0') keeps no validation split either: name a held-out dataset in "
        "data.valid_sets (NAME=PREFIX[:SAMPLES])")
