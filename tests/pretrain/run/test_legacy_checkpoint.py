"""Checkpoints written before the model code was restructured still load and compute the same.

``tests/fixtures/legacy`` holds tiny run checkpoints (siamese with LayerNorm, and
siamese_hybrid with the HybridNorm* block 0 of that time) written by the code of that time
through the real save path, with the logits that code computed on fixed tokens. Today's code
must accept the siamese one (identity check; its LayerNorms have biases, recorded before
``model.norm_bias`` existed), load every tensor strictly (model, optimizer, scheduler) and
compute those logits again. The HybridNorm* block 0 of that time is no longer built (the
official code's is): that checkpoint must be refused by name, not loaded into another model.
"""

import json
from pathlib import Path

import pytest
import torch

from model.builder import build_model, wrap_ddp
from pretrain.config import Config
from pretrain.optim import build_optimizer
from pretrain.run import checkpoint, identity
from pretrain.run.checkpoint import weights_source
from runtime import weights
from runtime.errors import CheckpointError
from tests.fixtures.make_legacy_checkpoints import FIXTURES, TOKENS, config_for, logits

NAMES = ["siamese", "siamese_hybrid_star"]
LOADABLE = ["siamese"]


def config_of(name: str) -> Config:
    return config_for(identity.upgraded(json.loads((FIXTURES / name / "model.json").read_text())))


def recorded_logits(name: str, device) -> torch.Tensor:
    return torch.load(FIXTURES / name / "logits.pt").to(device)


@pytest.mark.parametrize("name", NAMES)
def test_fixture_is_a_real_checkpoint(name):
    found = checkpoint.find(FIXTURES / name)
    assert found.name == "step_00000001"
    record = checkpoint.read_record(found)
    assert record["world_size"] == 1 and record["model"]["residual_scheme"] in name


def test_retired_hybridnorm_star_block_is_refused_by_name():
    fields = json.loads((FIXTURES / "siamese_hybrid_star" / "model.json").read_text())
    del fields["hybrid_prenorm_first_block"]
    today = config_for({**fields, "hybrid_first_block": "prenorm"})
    with pytest.raises(CheckpointError, match=r"model\.hybrid_first_block \('gated .*'prenorm'"):
        weights_source(str(FIXTURES / "siamese_hybrid_star"), today)


def test_a_checkpoint_from_before_experts_is_dense():
    """Identities recorded before ``model.num_experts`` existed are of dense models: experts
    asked of one are refused by name before a tensor is read, not left to megatron's load."""
    config = config_of("siamese")
    config.model.num_experts = 4
    with pytest.raises(CheckpointError,
                       match=r"holds another model: model\.num_experts \(0 in the checkpoint, "
                             r"4 here\)$"):
        weights_source(str(FIXTURES / "siamese"), config)


def test_legacy_layernorm_identity_needs_norm_bias():
    """The LayerNorm fixture has biases: a model without them is refused by name."""
    config = config_of("siamese")
    config.model.norm_bias = False
    with pytest.raises(CheckpointError, match=r"model\.norm_bias \(True in the checkpoint"):
        weights_source(str(FIXTURES / "siamese"), config)


@pytest.mark.parametrize("name", LOADABLE)
def test_legacy_weights_compute_the_recorded_logits(name, single_rank, device):
    config = config_of(name)
    found = weights_source(str(FIXTURES / name), config)
    chunks = build_model(config.model, config.parallel)
    before = logits(chunks, torch.tensor(TOKENS, device=device))
    weights.load(chunks, Path(found))
    after = logits(chunks, torch.tensor(TOKENS, device=device))
    expected = recorded_logits(name, device)
    assert not torch.allclose(before, expected, atol=1e-3)  # the load changed the model
    torch.testing.assert_close(after, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", LOADABLE)
def test_legacy_checkpoint_resumes(name, single_rank, device):
    config = config_of(name)
    found = checkpoint.find(FIXTURES / name)
    chunks = wrap_ddp(build_model(config.model, config.parallel), config.parallel)
    optimizer, scheduler = build_optimizer(config, chunks, torch.float32)
    checkpoint.load(found, checkpoint.read_record(found), chunks, optimizer, scheduler)
    assert scheduler.num_steps == 1
    state = list(optimizer.optimizer.state.values())
    assert state and all(s["exp_avg_sq"].abs().sum() > 0 for s in state)
    torch.testing.assert_close(logits(chunks, torch.tensor(TOKENS, device=device)),
                               recorded_logits(name, device), rtol=1e-5, atol=1e-5)
