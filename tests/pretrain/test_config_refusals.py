"""A config's mistakes are refused at once and all together.

At once: loading and checking a config imports neither torch nor megatron, so a mistyped key
or an impossible setting is said in a fraction of a second instead of after the imports (a
second or more; torch's distributed stack and megatron come after the checks). All together:
the independent rules all run, and every one broken is its own ``error:`` line, so a user
fixes them in one go; a single mistake stays the one line of the error it always was.
"""

from __future__ import annotations

import pytest

from pretrain.config import load_config
from runtime.errors import ConfigError, ConfigErrors, Findings, error_lines
from tests.pretrain_fixtures import cli

DEMO = ["train", "--config", "configs/demo-cpu.toml"]


def _errors(*overrides: str, **kwargs) -> list[str]:
    """The lines a config with ``overrides`` is refused with."""
    with pytest.raises(ConfigError) as refused:
        load_config(None, list(overrides), **kwargs)
    return str(refused.value).splitlines()


def test_a_valid_set_without_its_size_and_a_missing_file_are_both_named(tmp_path):
    """The validation set's rule and its missing file, known at once, are said at once (the
    file only for a command that reads the data next: alone, it is refused after a dry
    run's plan)."""
    news = tmp_path / "brown_news"
    overrides = ["--data.valid_samples=0", f"--data.valid_sets=news={news}"]
    assert _errors(*overrides, reads_data=True) == [
        f"data.valid_sets entry 'news={news}' gives no SAMPLES and data.valid_samples is 0: "
        f"give its size (news={news}:SAMPLES)",
        f"data.valid_sets 'news': data file '{news}.bin' does not exist"]
    assert len(_errors(*overrides)) == 1  # a tool that reads no data hears of no file


def test_a_global_batch_that_fits_neither_the_micro_batches_nor_the_valid_sets():
    found = _errors("--data.micro_batch_size=8", "--data.global_batch_size=12",
                    "--data.valid_samples=16", "--data.valid_sets=wiki=data/wiki:20",
                    world_size=1)
    assert found == [
        "data.valid_samples (16) must be a multiple of data.global_batch_size (12): an "
        "evaluation is whole batches",
        "data.valid_sets entry 'wiki=data/wiki:20': SAMPLES (20) must be a multiple of "
        "data.global_batch_size (12): an evaluation is whole batches",
        "data.global_batch_size (12) must be divisible by data.micro_batch_size x "
        "data-parallel size (8 x 1)"]


def test_mistakes_across_sections_and_groups_are_all_named():
    """Unknown keys and wrong types of every section; then, in a config that loads, the
    model's, the layout's and the other sections' rules."""
    assert [line.split(" (")[0] for line in _errors(
        "--model.num_expert=8", "--optim.lr=fast", "--run.stepz=3")] == [
        "unknown config key model.num_expert", "optim.lr", "unknown config key run.stepz"]
    assert [line.split(" (")[0] for line in _errors(
        "--model.num_experts=4", "--model.moe_router_topk=8", "--model.num_layers=3",
        "--parallel.pp=2", "--optim.beta2=2", "--guard.sigma=0", "--run.keep_last=0")] == [
        "model.num_layers", "model.moe_router_topk", "run.keep_last", "guard.sigma",
        "optim.beta2"]


def test_a_rule_that_reads_another_waits_for_it():
    """Zero steps are not also a warm-up too long for them, a zero batch no division by zero,
    an infinite rate no second line about its first step."""
    assert _errors("--run.steps=0") == ["run.steps (0) must be >= 1"]
    assert _errors("--data.global_batch_size=0", world_size=1) == [
        "data.global_batch_size (0) must be >= 1"]
    assert _errors("--optim.lr=inf") == ["optim.lr (inf) must be a finite number"]


def test_one_mistake_is_the_error_it_always_was():
    with pytest.raises(ConfigError) as one:
        load_config(None, ["--model.num_experts=4", "--model.moe_router_topk=8"])
    assert type(one.value) is ConfigError
    assert str(one.value) == "model.moe_router_topk (8) must be in [1, model.num_experts (4)]"
    with pytest.raises(ConfigErrors) as two, Findings() as found:
        found.require(False, "a")
        found.check(load_config, None, ["--run.steps=0", "--run.keep_last=0"])
    assert two.value.errors[0].args == ("a",) and str(two.value).splitlines() == [
        "a", "run.steps (0) must be >= 1", "run.keep_last (0) must be >= 1"]
    assert error_lines("a\nb") == "error: a\nerror: b" and error_lines("a") == "error: a"


def _refused(*args: str):
    """``python -m pretrain ARGS`` in a fresh interpreter that logs every import
    (PYTHONPROFILEIMPORTTIME, which also keeps it from the preloaded one): its exit status,
    its ``error:`` lines and the modules it imported."""
    done = cli(*args, check=False, extra_env={"PYTHONPROFILEIMPORTTIME": "1"})
    lines = done.stderr.strip().splitlines()
    imported = {line.rpartition("|")[2].strip() for line in lines
                if line.startswith("import time:")}
    assert "pretrain.config" in imported  # the log is there and covers the config's load
    said = [line for line in lines if not line.startswith("import time:")]
    assert said and all(line.startswith("error: ") for line in said), said
    return done.returncode, said, imported


@pytest.mark.slow
@pytest.mark.parametrize("mistake, said", [
    (["--model.num_expert=8"], "unknown config key model.num_expert (did you mean "
                               "model.num_experts?)"),
    (["--model.num_experts=4", "--model.moe_router_topk=8"],
     "model.moe_router_topk (8) must be in [1, model.num_experts (4)]"),
])
def test_a_config_mistake_is_said_before_torch_is_imported(mistake, said):
    """The user's two cases: exit 2, their line first (then, on a machine without the
    demo's data, the files it lacks), and no torch or megatron module imported before."""
    code, lines, imported = _refused(*DEMO, *mistake)
    assert code == 2 and said in lines[0], lines
    assert all("does not exist" in line for line in lines[1:]), lines
    assert sorted(m for m in imported if m.split(".")[0] in ("torch", "megatron")) == []


@pytest.mark.slow
def test_the_cli_says_each_mistake_on_its_own_line(tmp_path):
    """Exit 2, every line an ``error:`` line, each mistake named once (the demo's own data
    may be missing too on this machine: then it is named as well)."""
    code, lines, _ = _refused(*DEMO, "--data.valid_samples=0",
                              f"--data.valid_sets=news={tmp_path}/news",
                              "--data.global_batch_size=24")
    assert code == 2, lines
    for said in ("gives no SAMPLES and data.valid_samples is 0",
                 f"data.valid_sets 'news': data file '{tmp_path}/news.bin' does not exist",
                 "data.global_batch_size (24) must be divisible by data.micro_batch_size x "
                 "data-parallel size (16 x 1)"):
        assert sum(said in line for line in lines) == 1, (said, lines)
