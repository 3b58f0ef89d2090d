"""optim.name muon's settings: each mistake one line naming the field, the rule and the value;
a Muon setting given to an AdamW run is refused rather than silently ignored; what Muon does
not support yet is named (docs/limits.md)."""

from __future__ import annotations

import pytest

from pretrain.config import MUON_FIELDS, MuonAdjustLr, OptimConfig, OptimName, load_config
from runtime.errors import ConfigError

MUON = ("--optim.name=muon",)


def _errors(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as refused:
        load_config(None, list(overrides))
    return str(refused.value).splitlines()


def test_adamw_is_the_default_and_muon_loads_with_its_defaults():
    assert OptimConfig().name is OptimName.ADAMW
    config = load_config(None, list(MUON))
    assert config.optim.name is OptimName.MUON
    assert config.optim.muon_adjust_lr_fn is MuonAdjustLr.MATCH_RMS_ADAMW


@pytest.mark.parametrize("override, said", [
    ("--optim.muon_lr=-1", "optim.muon_lr (-1.0) must be >= 0 (0: optim.lr)"),
    ("--optim.muon_momentum=1", "optim.muon_momentum (1.0) must be in [0, 1)"),
    ("--optim.muon_momentum=-0.1", "optim.muon_momentum (-0.1) must be in [0, 1)"),
    ("--optim.muon_ns_steps=0", "optim.muon_ns_steps (0) must be in [1, 99]"),
    ("--optim.muon_ns_steps=100", "optim.muon_ns_steps (100) must be in [1, 99]"),
    ("--optim.muon_weight_decay=-0.1", "optim.muon_weight_decay (-0.1) must be >= 0"),
    ("--optim.muon_adjust_lr_fn=moonshot", "optim.muon_adjust_lr_fn ('moonshot') must be one "
     "of: match_rms_adamw, original"),
    ("--optim.name=lion", "optim.name ('lion') must be one of: adamw, muon"),
])
def test_a_muon_mistake_is_one_line(override, said):
    assert _errors(*MUON, override) == [said]


def test_every_muon_field_given_to_adamw_is_named():
    """Each Muon field set away from its default while optim.name is adamw."""
    values = {"muon_lr": "0.02", "muon_weight_decay": "0.0", "muon_momentum": "0.9",
              "muon_nesterov": "false", "muon_ns_steps": "3", "muon_adjust_lr_fn": "original"}
    assert set(values) == set(MUON_FIELDS)  # a new Muon field is tested here too
    lines = _errors(*(f"--optim.{name}={value}" for name, value in values.items()))
    assert [line.split(" (")[0] for line in lines] == [f"optim.{n}" for n in MUON_FIELDS]
    assert lines[0] == ("optim.muon_lr (0.02) applies only to optim.name muon, not adamw; set "
                        "--optim.name=muon or remove it")


def test_muon_takes_the_distributed_optimizer_and_experts_but_not_te_grouped_experts():
    config = load_config(None, [*MUON, "--parallel.distributed_optimizer=true",
                                "--model.num_experts=4", "--model.transformer_impl=local"])
    assert config.parallel.distributed_optimizer and config.model.num_experts == 4
    assert ("optim.name muon does not step the routed experts of model.transformer_impl te "
            "(Transformer Engine's grouped GEMM) yet: set --model.transformer_impl=local"
            in _errors(*MUON, "--model.num_experts=4", "--model.transformer_impl=te"))


def test_a_resume_with_the_other_optimizer_is_refused_before_a_tensor_is_read():
    """The start's check of the checkpoint's recorded settings (the load checks again, for a
    checkpoint without them: tests/pretrain/train/test_muon.py)."""
    from pretrain.run import identity
    from runtime.errors import CheckpointError

    config = load_config(None, list(MUON))
    settings = {"parallel": {"distributed_optimizer": config.parallel.distributed_optimizer},
                "optim": {"lr": 3e-4}}
    with pytest.raises(CheckpointError) as refused:
        identity.check_optimizer_layout(settings, config, "runs/a/checkpoints/step_00000004")
    assert str(refused.value) == (
        "checkpoint 'runs/a/checkpoints/step_00000004' holds the optimizer state of "
        "optim.name=adamw, and this start has muon: resume with --optim.name=adamw, or start a "
        "new run from its weights with --run.init_from (the optimizer state starts anew)")
    settings["optim"]["name"] = "muon"
    identity.check_optimizer_layout(settings, config, "runs/a/checkpoints/step_00000004")
