"""A resume may change settings that do not change the data (a lower optim.clip_grad, another
optim.beta2): each change is printed and recorded, with the step it applies from, in the run
folder and W&B; settings that moved keep old configs loadable."""

import json

import pytest

from pretrain.config import changed_settings, load_config
from tests.pretrain_fixtures import cli, train_args
from tests.wandb_reader import read_run, read_summary


def test_changed_settings_names_each_field_with_both_values():
    before = {"optim": {"lr": 1e-3, "beta2": 0.95}, "run": {"steps": 3}}
    after = {"optim": {"lr": 1e-3, "beta2": 0.5}, "run": {"steps": 5, "seed": 1},
             "guard": {"spikes": True}}
    # run.seed and [guard] are settings the older checkpoint did not have: not changes
    assert changed_settings(before, after) == {"optim.beta2": [0.95, 0.5], "run.steps": [3, 5]}
    assert changed_settings(after, after) == {}


def test_a_moved_key_still_loads_into_its_new_place(tmp_path):
    old = tmp_path / "old.toml"
    old.write_text("[run]\nsteps = 20\nmax_nonfinite_steps = 7\n")
    assert load_config(str(old)).guard.max_skipped == 7
    assert load_config(None, ["--run.max_nonfinite_steps=4"]).guard.max_skipped == 4
    both = load_config(str(old), ["--guard.max_skipped=2"])
    assert both.guard.max_skipped == 2  # the new key wins


@pytest.mark.slow
def test_a_resume_with_edited_settings_prints_and_records_each_change(data, tmp_path):
    run = tmp_path / "run"
    base = ["--logging.wandb_mode=offline", "--data.valid_samples=0"]
    cli(*train_args(data, run, "--run.steps=3", *base))
    config = run / "config.toml"
    text = config.read_text()
    assert "clip_grad = 1.0" in text and "beta2 = 0.95" in text
    config.write_text(text.replace("clip_grad = 1.0", "clip_grad = 0.1")
                      .replace("beta2 = 0.95", "beta2 = 0.5"))
    done = cli("train", "--config", str(config), "--run.steps=5",
               "--optim.override_schedule=true")
    assert "resumed with optim.beta2 = 0.5 (was 0.95 until step 3)" in done.stderr
    assert "resumed with optim.clip_grad = 0.1 (was 1.0 until step 3)" in done.stderr
    expected = {"optim.beta2": [0.95, 0.5], "optim.clip_grad": [1.0, 0.1],
                "optim.override_schedule": [False, True], "run.steps": [3, 5]}
    lines = (run / "settings_changes.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"step": 3, "changes": expected}]
    files = sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))
    resumed = max(files, key=lambda f: f.stat().st_mtime)
    assert read_run(resumed)[0]["optim"]["clip_grad"] == 0.1
    assert read_summary(resumed)["settings_changes/optim.beta2"] == "0.95 -> 0.5 at step 3"
    again = cli("train", "--config", str(config), "--run.steps=5",
                "--optim.override_schedule=true")  # the same settings: nothing to report
    assert "resumed with" not in again.stderr
    assert len((run / "settings_changes.jsonl").read_text().splitlines()) == 1


def test_the_command_line_help_names_every_config_section():
    import dataclasses

    from pretrain.arguments import OVERRIDES_HELP
    from pretrain.config import Config

    listed = OVERRIDES_HELP.split("Sections:")[1].split(";")[0]
    assert [s.strip() for s in listed.split(",")] == [f.name for f in dataclasses.fields(Config)]
