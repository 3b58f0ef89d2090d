"""DP=2 with megatron's DistributedOptimizer takes the same AdamW step as one process."""

import json

import pytest
import torch

from model.builder import build_model
from model.config import ParallelConfig
from runtime import weights
from tests.helpers import spawn, tiny_model
from tests.parity_worker import run_optimizer_step


def stepped_weights(folder, scheme) -> dict:
    [model] = build_model(tiny_model(scheme), ParallelConfig())
    weights.load([model], str(folder / "stepped"))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["siamese", "siamese_hybrid"])
def test_sharded_optimizer_step_matches_single_process(single_rank, scheme, tmp_path):
    torch.manual_seed(11)
    [model] = build_model(tiny_model(scheme), ParallelConfig())
    weights.save([model], str(tmp_path / "weights"))
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    for folder in (single, sharded):
        folder.mkdir()
        (folder / "weights").symlink_to(tmp_path / "weights")
    spawn(1, run_optimizer_step, scheme, str(single), False)
    spawn(2, run_optimizer_step, scheme, str(sharded), True)
    norms = [json.loads((f / "grad_norm.json").read_text()) for f in (single, sharded)]
    assert norms[1] == pytest.approx(norms[0], rel=1e-5)
    before = {n: p.detach() for n, p in model.named_parameters()}
    expected, got = stepped_weights(single, scheme), stepped_weights(sharded, scheme)
    for name, value in got.items():
        assert not torch.equal(expected[name], before[name]), f"{name} did not move"
        err = (value - expected[name]).abs().max().item()
        assert err <= 1e-6, (name, err)
