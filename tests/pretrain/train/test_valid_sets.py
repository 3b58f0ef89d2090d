"""Further validation sets (data.valid_sets): entries parsed and checked when the config loads;
every evaluation (the loop's, at the start and the end, and ``eval``) reports each set as
val/<name>/{loss,ppl,samples} next to the default set's unchanged val_loss; a set added on
resume is allowed; TP=2 gives the single-process value; the sample count a set may hold is
megatron's own one-pass count."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset

from pretrain.config import ValidSet, load_config, valid_sets
from pretrain.data.batches import _dataset_config
from pretrain.data.checks import check_data
from pretrain.data.tokenizer import open_tokenizer
from pretrain.train.evaluate import require_validation
from runtime.errors import ConfigError, DataError
from tests.pretrain_fixtures import REPO, TINY, cli, metrics, train_args
from tests.wandb_reader import read_run

# --- entries, checked when the config loads (fast) ---


def _load(*overrides: str, training: bool = True):
    return load_config(None, ["--data.global_batch_size=8", "--data.valid_samples=16",
                              *overrides], training=training)


def _sets(*overrides: str) -> list[ValidSet]:
    return valid_sets(_load(*overrides).data)


def test_entries_parse_with_and_without_a_sample_count():
    assert _sets('--data.valid_sets=["wiki=data/wiki_text_document:256", '
                 '"code-2=data/code_text_document"]') == [
        ValidSet("wiki", "data/wiki_text_document", 256),
        ValidSet("code-2", "data/code_text_document", 16)]  # default: data.valid_samples
    # one by one or comma-separated on the command line, as every list field
    assert _sets("--data.valid_sets=a=x:8", "--data.valid_sets=b=y") == \
        _sets("--data.valid_sets=a=x:8,b=y") == [ValidSet("a", "x", 8), ValidSet("b", "y", 16)]
    assert _sets() == []


@pytest.mark.parametrize("entries, fragments", [
    (["wiki"], ["data.valid_sets entry 'wiki' must look like NAME=PREFIX[:SAMPLES]"]),
    (["wiki="], ["entry 'wiki=' must look like"]),
    (["=data/wiki"], ["NAME ('') must be letters, digits, _ or -"]),
    (["my wiki=data/wiki"], ["NAME ('my wiki')", "val/NAME/loss"]),
    (["wiki/en=data/wiki"], ["NAME ('wiki/en')"]),
    (["wiki=data/wiki:lots"], ["SAMPLES ('lots') must be an integer"]),
    (["wiki=data/wiki:0"], ["SAMPLES (0) must be > 0"]),
    (["wiki=data/wiki:-8"], ["SAMPLES (-8) must be > 0"]),
    (["wiki=data/wiki:12"], ["SAMPLES (12) must be a multiple of data.global_batch_size (8)"]),
    (["wiki=data/wiki.bin"], ["names a file", "('data/wiki')"]),
    (["wiki=data/a:8", "wiki=data/b:16"], ["data.valid_sets names 'wiki' twice"]),
], ids=["no-name", "no-prefix", "empty-name", "space", "slash", "not-a-number", "zero",
        "negative", "part-batch", "a-file", "duplicate"])
def test_a_bad_entry_is_one_line_naming_it(entries, fragments):
    with pytest.raises(ConfigError) as bad:  # when the config loads
        _load(f"--data.valid_sets={json.dumps(entries)}")
    message = str(bad.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_without_a_default_set_each_entry_needs_its_size():
    with pytest.raises(ConfigError, match=r"gives no SAMPLES and data\.valid_samples is 0: "
                                          r"give its size \(wiki=data/wiki:SAMPLES\)"):
        _load("--data.valid_samples=0", "--data.valid_sets=wiki=data/wiki")
    assert _sets("--data.valid_samples=0", "--data.valid_sets=wiki=data/wiki:8") == \
        [ValidSet("wiki", "data/wiki", 8)]


def test_eval_may_score_further_sets_alone():
    require_validation(_load("--data.valid_samples=0", "--data.valid_sets=wiki=data/wiki:8",
                             training=False))
    with pytest.raises(ConfigError, match=r"data\.valid_samples is 0 and data\.valid_sets is "
                                          r"empty"):
        require_validation(_load("--data.valid_samples=0", training=False))


# --- the data a set holds (in process, on the session's corpus) ---


def _part(source: dict, folder: Path, documents: int = 20) -> str:
    """A second dataset: the first ``documents`` documents of the corpus, prepared by the CLI."""
    lines = Path(source["corpus"]).read_text().splitlines()[:documents]
    (folder / "part.jsonl").write_text("\n".join(lines) + "\n")
    cli("prepare-data", str(folder / "part.jsonl"), "--tokenizer", source["tokenizer"],
        "--output", str(folder / "part"))
    return str(folder / "part")


def test_a_set_may_hold_megatrons_one_pass_count_and_no_more(single_rank, data, tmp_path):
    """The largest count the refusal names is the largest whole-batch count within one pass of
    megatron over the whole prefix: accepted; the next multiple of the batch is refused."""
    part = _part(data, tmp_path)
    tokenizer = open_tokenizer(data["tokenizer"])

    def config(samples: int):
        return load_config(str(REPO / "configs" / "demo-cpu.toml"), [
            *TINY, f"--data.prefixes={data['prefix']}", f"--data.tokenizer={data['tokenizer']}",
            f"--run.dir={tmp_path / 'run'}", f"--data.cache_dir={tmp_path / 'cache'}",
            f"--data.valid_sets=part={part}:{samples}"])

    one_pass = dataclasses.replace(_dataset_config(config(8), tokenizer),
                                   blend=([part], None), split="0,100,0")
    _, whole, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [None, None, None], lambda: True, one_pass).build()
    available, batch = len(whole), 8
    largest = available // batch * batch
    with pytest.raises(DataError) as refused:
        check_data(config(largest + batch), tokenizer)
    message = str(refused.value)
    assert "\n" not in message
    for fragment in ("data.valid_sets 'part'", f"for {largest + batch} validation sequences",
                     f"hold {available};", f"the largest SAMPLES that fits is {largest}"):
        assert fragment in message, (fragment, message)
    check_data(config(largest), tokenizer)


# --- through the CLI: every evaluation, eval, resume, TP=2 ---

STEPS, EVERY, SAMPLES = 4, 2, 24


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory) -> dict:
    """The same run with the further set ``part`` (W&B offline) and without it."""
    root = tmp_path_factory.mktemp("valid-sets")
    part = _part(data, root)
    plain = [f"--run.steps={STEPS}", f"--run.eval_interval={EVERY}"]
    extra = f"--data.valid_sets=part={part}:{SAMPLES}"
    done = cli(*train_args(data, root / "with", *plain, extra, "--logging.wandb_mode=offline"))
    cli(*train_args(data, root / "without", *plain))
    return {"root": root, "part": part, "plain": plain, "extra": extra, "stderr": done.stderr}


def _validations(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in metrics(run) if any(k.startswith("val") for k in r)}


def test_every_evaluation_reports_the_set_beside_an_unchanged_default(runs):
    with_set = _validations(runs["root"] / "with")
    without = _validations(runs["root"] / "without")
    assert sorted(with_set) == sorted(without) == [0, 2, 4]
    for step, record in with_set.items():
        assert record["val/part/samples"] == SAMPLES
        assert math.isfinite(record["val/part/loss"]) and record["val/part/loss"] > 0
        assert record["val/part/ppl"] == pytest.approx(math.exp(record["val/part/loss"]))
        assert record["val_loss"] == without[step]["val_loss"]  # exactly
        assert record["val_samples"] == without[step]["val_samples"]
        assert not any(k.startswith("val/") for k in without[step])
        line = (f"validation part at step {step}: loss {record['val/part/loss']:.4f}, "
                f"perplexity {record['val/part/ppl']:.1f}")
        assert line in runs["stderr"], line
    (wandb_file,) = (runs["root"] / "with" / "wandb").glob("offline-run-*/run-*.wandb")
    _, history = read_run(wandb_file)
    logged = {h["_step"]: h for h in history if "val/part/loss" in h}
    assert {s: h["val/part/loss"] for s, h in logged.items()} == \
        {s: r["val/part/loss"] for s, r in with_set.items()}


def test_eval_of_the_final_checkpoint_gives_the_runs_last_value(runs):
    run = runs["root"] / "with"
    done = cli("eval", "--checkpoint", str(run / "checkpoints"))
    result = json.loads(done.stdout.strip().splitlines()[-1])
    last = _validations(run)[STEPS]
    for key in ("val/part/loss", "val_loss"):
        assert result[key] == pytest.approx(last[key], rel=0, abs=1e-9), key
    assert result["val/part/samples"] == SAMPLES


def test_a_set_added_on_resume_is_allowed_and_measures_the_same_weights(runs, data, tmp_path):
    """The further set is not part of the data identity: the run trained without it resumes
    with it (here at its end, where a resume validates once more), and since the set changed
    no training sample, its weights score what the run trained with the set scored."""
    run = tmp_path / "resumed"
    shutil.copytree(runs["root"] / "without", run)
    cli(*train_args(data, run, *runs["plain"], runs["extra"]))
    last = [r for r in metrics(run) if "val/part/loss" in r]
    assert [r["step"] for r in last] == [STEPS]
    assert last[0]["val/part/loss"] == _validations(runs["root"] / "with")[STEPS]["val/part/loss"]
    changes = json.loads((run / "settings_changes.jsonl").read_text().splitlines()[-1])
    assert changes["changes"]["data.valid_sets"] == [[], [runs["extra"].split("=", 1)[1]]]


def test_tensor_parallel_gives_the_single_process_value(runs, data, tmp_path):
    run = tmp_path / "tp2"
    done = cli(*train_args(data, run, *runs["plain"], runs["extra"], "--parallel.tp=2"),
               nproc=2)
    # the start-up checks run on every rank; their lines are printed once per launch
    assert done.stderr.count("training tokens; the run reads") == 1, done.stderr
    single = _validations(runs["root"] / "with")
    sharded = _validations(run)
    assert sorted(sharded) == sorted(single)
    for step, record in sharded.items():
        assert record["val/part/loss"] == pytest.approx(single[step]["val/part/loss"],
                                                        rel=0, abs=1e-5), step


def test_further_sets_alone_validate_a_run_without_a_default_set(runs, data, tmp_path):
    """Train on every document of the corpus (no validation split) and validate on ``part``."""
    run = tmp_path / "alone"
    cli(*train_args(data, run, "--run.steps=2", "--optim.warmup_steps=1",
                    "--run.eval_interval=2", "--data.split=100,0,0", "--data.valid_samples=0",
                    f"--data.valid_sets=part={runs['part']}:16"))
    records = _validations(run)
    assert sorted(records) == [0, 2]
    assert all("val_loss" not in r and r["val/part/samples"] == 16 for r in records.values())
