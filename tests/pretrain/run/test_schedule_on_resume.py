"""A resume may change every field of the LR and weight-decay schedule (with
optim.override_schedule): the run then follows the new schedule from the checkpoint's step on,
with the Adam moments it saved, under either optimizer. Without the switch each change is one
line naming the field.

The expected learning rates are written out here from the schedule's definition (linear
warm-up from 0, then the decay style down to min_lr at run.steps), not read from megatron's
scheduler."""

import dataclasses
import math

import pytest
import torch

from model.builder import build_model, wrap_ddp
from model.config import ModelConfig, ParallelConfig
from pretrain.config import Config, DataConfig, OptimConfig, RunConfig, validate
from pretrain.optim import build_optimizer
from pretrain.run import checkpoint
from runtime.errors import ConfigError
from tests.fixtures.make_legacy_checkpoints import TINY, train_step

SAVED_AT = 4
BEFORE = OptimConfig(lr=3e-3, min_lr=3e-4, warmup_steps=2, weight_decay=0.1)

# One change of each schedule field: (what changes, optim fields, run.steps).
CHANGES = {
    "optim.lr": ({"lr": 1e-3}, 10),
    "optim.min_lr": ({"min_lr": 1e-5}, 10),
    "optim.warmup_steps": ({"warmup_steps": 6}, 10),
    "optim.decay_style": ({"decay_style": "linear"}, 10),
    "optim.wsd_decay_steps": ({"decay_style": "wsd", "wsd_decay_steps": 3}, 10),
    "optim.wsd_decay_shape": ({"decay_style": "wsd", "wsd_decay_steps": 4,
                               "wsd_decay_shape": "minus_sqrt"}, 10),
    "optim.weight_decay": ({"weight_decay": 0.01}, 10),
    "run.steps": ({}, 20),
}


def expected_lr(optim: OptimConfig, steps: int, step: int) -> float:
    """The LR the schedule gives after ``step`` scheduler steps."""
    if optim.warmup_steps and step <= optim.warmup_steps:
        return optim.lr * step / optim.warmup_steps
    if optim.decay_style == "constant":
        return optim.lr
    if step > steps:
        return optim.min_lr
    span = optim.lr - optim.min_lr
    done = (step - optim.warmup_steps) / (steps - optim.warmup_steps)
    if optim.decay_style == "linear":
        return optim.min_lr + span * (1 - done)
    if optim.decay_style == "cosine":
        return optim.min_lr + span * (1 + math.cos(math.pi * done)) / 2
    stable_until = steps - optim.wsd_decay_steps  # wsd
    if step <= stable_until:
        return optim.lr
    fraction = (step - stable_until) / optim.wsd_decay_steps
    shape = {"linear": 1 - fraction, "cosine": (1 + math.cos(math.pi * fraction)) / 2,
             "minus_sqrt": 1 - math.sqrt(fraction)}[optim.wsd_decay_shape]
    return optim.min_lr + span * shape


def _config(optim: OptimConfig, steps: int, distributed: bool) -> Config:
    config = Config(model=ModelConfig(**TINY),
                    parallel=ParallelConfig(distributed_optimizer=distributed),
                    data=DataConfig(prefixes=["unused"], global_batch_size=2,
                                    micro_batch_size=2),
                    run=RunConfig(steps=steps, seed=7), optim=optim)
    validate(config, world_size=1)
    return config


def _build(config: Config):
    chunks = wrap_ddp(build_model(config.model, config.parallel), config.parallel)
    optimizer, scheduler = build_optimizer(config, chunks, torch.float32)
    return chunks, optimizer, scheduler


def _moments(optimizer) -> list[torch.Tensor]:
    return [value.clone() for opt in getattr(optimizer, "chained_optimizers", [optimizer])
            for state in opt.optimizer.state.values()
            for key, value in sorted(state.items()) if key in ("exp_avg", "exp_avg_sq")]


@pytest.fixture(scope="module", params=[False, True], ids=["optimizer", "distributed"])
def saved(request, single_rank, tmp_path_factory):
    """A checkpoint of SAVED_AT real steps under BEFORE's schedule (run.steps 10), and the
    Adam moments it holds."""
    distributed = request.param
    torch.manual_seed(0)
    chunks, optimizer, scheduler = _build(_config(BEFORE, 10, distributed))
    for _ in range(SAVED_AT):
        train_step(chunks, optimizer, scheduler)
    root = tmp_path_factory.mktemp("checkpoints")
    folder = checkpoint.save(root, SAVED_AT, chunks, optimizer, scheduler, keep_last=1,
                             record={})
    return distributed, folder, _moments(optimizer)


@pytest.mark.parametrize("field", list(CHANGES))
def test_each_schedule_field_changes_on_resume_keeping_the_moments(saved, field):
    distributed, folder, moments = saved
    fields, steps = CHANGES[field]
    after = dataclasses.replace(BEFORE, override_schedule=True, **fields)
    chunks, optimizer, scheduler = _build(_config(after, steps, distributed))
    checkpoint.load(folder, checkpoint.read_record(folder), chunks, optimizer, scheduler)
    loaded = _moments(optimizer)
    assert loaded and all(torch.equal(a, b) for a, b in zip(loaded, moments, strict=True))
    for step in range(SAVED_AT, SAVED_AT + 4):
        for group in optimizer.param_groups:  # what the next optimizer step uses
            assert group["lr"] == pytest.approx(expected_lr(after, steps, step), rel=1e-9), \
                f"{field}: the LR after {step} steps"
            decay = group.get("wd_mult", 1.0) * after.weight_decay
            assert group["weight_decay"] == pytest.approx(decay, rel=1e-12)
        scheduler.step(1)


@pytest.mark.parametrize("field", list(CHANGES))
def test_a_schedule_change_without_the_switch_is_one_line_naming_the_field(saved, field):
    distributed, folder, _ = saved
    fields, steps = CHANGES[field]
    after = dataclasses.replace(BEFORE, **fields)
    chunks, optimizer, scheduler = _build(_config(after, steps, distributed))
    with pytest.raises(ConfigError, match="set --optim.override_schedule=true") as err:
        checkpoint.load(folder, checkpoint.read_record(folder), chunks, optimizer, scheduler)
    changed = str(err.value).split(" ")[0]
    # a WSD change also changes decay_style; the first differing field is named
    assert changed == field or (changed == "optim.decay_style" and "wsd" in field)


def test_the_expected_schedule_matches_the_checkpointed_one_when_nothing_changes(saved):
    """The transcription above against the untouched schedule: the control that shows the
    test's formula and the scheduler agree where no change is involved."""
    distributed, folder, _ = saved
    chunks, optimizer, scheduler = _build(_config(BEFORE, 10, distributed))
    checkpoint.load(folder, checkpoint.read_record(folder), chunks, optimizer, scheduler)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(expected_lr(BEFORE, 10, SAVED_AT))
