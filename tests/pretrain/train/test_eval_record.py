"""What `eval` records: the tokenizer file it used, which may be any file with the content the
checkpoint was trained with (a copy at another path is accepted and named)."""

import json
import shutil

import pytest

from tests.pretrain_fixtures import cli


@pytest.mark.slow
def test_eval_records_the_tokenizer_it_used(data, trained_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)  # eval appends to the run folder; the fixture is shared
    copy = tmp_path / "elsewhere" / "same.model"
    copy.parent.mkdir()
    shutil.copyfile(data["tokenizer"], copy)
    done = cli("eval", "--config", str(run / "config.toml"), "--checkpoint",
               str(run / "checkpoints"), f"--data.tokenizer={copy}")
    printed = json.loads(done.stdout.strip().splitlines()[-1])
    logged = json.loads((run / "eval.jsonl").read_text().splitlines()[-1])
    assert printed == logged and logged["tokenizer"] == str(copy)
    assert logged["tokenizer"] != str(data["tokenizer"])
