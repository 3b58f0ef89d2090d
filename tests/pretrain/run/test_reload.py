"""A checkpoint loaded into a model, optimizer and schedule that have trained on (what a guard
rollback does) leaves them exactly as a load into fresh ones: megatron's scheduler load adds
the saved step count to the live one, which after a rollback put the LR schedule as many steps
ahead as the run had taken."""

import json

import pytest
import torch

from model.builder import build_model, wrap_ddp
from pretrain.optim import build_optimizer
from pretrain.run import checkpoint, identity
from tests.fixtures.make_legacy_checkpoints import FIXTURES, config_for

FIXTURE = FIXTURES / "siamese"


def _loaded(config, trained_on: int):
    """(scheduler state, LR in force, each parameter's Adam step) after loading the fixture
    into an optimizer and schedule that first took ``trained_on`` steps."""
    chunks = wrap_ddp(build_model(config.model, config.parallel), config.parallel)
    optimizer, scheduler = build_optimizer(config, chunks, torch.float32)
    found = checkpoint.find(FIXTURE)
    record = checkpoint.read_record(found)
    checkpoint.load(found, record, chunks, optimizer, scheduler)
    for _ in range(trained_on):  # what the steps after the checkpoint advance
        scheduler.step(increment=1)
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            for state in opt.optimizer.state.values():
                state["step"] += 1
    checkpoint.load(found, record, chunks, optimizer, scheduler)
    steps = [float(state["step"]) for opt in getattr(optimizer, "chained_optimizers",
                                                      [optimizer])
             for state in opt.optimizer.state.values()]
    return scheduler.state_dict(), optimizer.param_groups[0]["lr"], steps


def test_a_reload_after_more_steps_restores_the_saved_schedule_and_adam_steps(single_rank):
    config = config_for(identity.upgraded(json.loads((FIXTURE / "model.json").read_text())))
    state, lr, steps = _loaded(config, trained_on=7)
    assert state["num_steps"] == 1  # the fixture's: one step taken
    # linear warm-up from 0 to optim.lr over optim.warmup_steps: one step in
    assert lr == pytest.approx(config.optim.lr / config.optim.warmup_steps, rel=1e-12)
    assert steps and all(s == 1.0 for s in steps)
    assert (state, lr, steps) == _loaded(config, trained_on=0)
