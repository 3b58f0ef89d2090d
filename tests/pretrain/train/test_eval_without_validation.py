"""A run trained with validation off (data.valid_samples = 0, no data.valid_sets), as a user
meets it: train ends saying where it stopped and why there is no validation loss; eval refuses
in one line naming the setting and how to give one, and that advice, run as written, scores the
checkpoint; eval never speaks of the run's training epochs; the checkpoint's other commands
are not refused."""

from __future__ import annotations

import json
import re

import pytest

from tests.pretrain_fixtures import cli, train_args


@pytest.mark.slow
def test_a_run_without_validation_is_told_what_eval_needs(data, tmp_path):
    run = tmp_path / "run"
    trained = cli(*train_args(data, run, "--run.steps=3", "--data.valid_samples=0"))
    assert json.loads(trained.stdout.strip().splitlines()[-1]) == {"step": 3}
    assert ("[pretrain] finished at step 3 without validation: data.valid_samples is 0 and "
            "data.valid_sets is empty") in trained.stderr.splitlines(), trained.stderr[-2000:]

    checkpoint = str(run / "checkpoints")
    refused = cli("eval", "--checkpoint", checkpoint, check=False)
    assert refused.returncode == 2, refused.stderr[-2000:]
    line = refused.stderr.strip().splitlines()[-1]
    assert line == ("error: eval has nothing to evaluate: data.valid_samples is 0 and "
                    "data.valid_sets is empty; give --data.valid_samples=8 to score that many "
                    "sequences of the validation split (any multiple of "
                    "data.global_batch_size), or name a held-out dataset in data.valid_sets")
    assert not refused.stdout.strip()  # no bare {} beside it

    advice = re.search(r"give (--data\.valid_samples=\d+) ", line).group(1)
    scored = cli("eval", "--checkpoint", checkpoint, advice)
    result = json.loads(scored.stdout.strip().splitlines()[-1])
    assert result["val_samples"] == 8 and result["val_loss"] > 0
    assert "epoch" not in scored.stderr, scored.stderr[-2000:]  # training's, not eval's
    assert "the run reads" in trained.stderr  # where it belongs

    sampled = cli("generate", "--checkpoint", checkpoint, "--prompt", "The", "--max-tokens", "2")
    assert json.loads(sampled.stdout.strip().splitlines()[-1])["prompt"] == "The"
