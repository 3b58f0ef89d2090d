"""DP=2 with megatron's DistributedOptimizer takes the same AdamW step as one process; so do
models with experts, whose expert weights megatron keeps in an optimizer of their own at every
layout (model.moe.mark_experts; their gradients reduced over the expert data-parallel group,
their share of the gradient norm summed over the expert-parallel ranks)."""

import json

import pytest
import torch

from model.builder import build_model
from model.config import ParallelConfig
from runtime import weights
from tests.helpers import spawn, tiny_model
from tests.parity_worker import run_optimizer_step


def stepped_weights(folder, scheme, overrides: dict | None = None) -> dict:
    [model] = build_model(tiny_model(scheme, **(overrides or {})), ParallelConfig())
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


@pytest.mark.slow
def test_context_parallel_sharded_optimizer_step_matches_single_process(single_rank, tmp_path):
    """CP=2 x DP=2 with the distributed optimizer: gradients reduced over the data x context
    ranks (megatron's DDP), optimizer state sharded over the data-parallel ranks, the same
    step as one process."""
    torch.manual_seed(11)
    [model] = build_model(tiny_model("siamese"), ParallelConfig())
    weights.save([model], str(tmp_path / "weights"))
    for name, world, layout in (("single", 1, {}), ("cp2-dp2", 4, {"cp": 2})):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "weights").symlink_to(tmp_path / "weights")
        spawn(world, run_optimizer_step, "siamese", str(folder), world > 1, layout)
    norms = [json.loads((tmp_path / f / "grad_norm.json").read_text())
             for f in ("single", "cp2-dp2")]
    assert norms[1] == pytest.approx(norms[0], rel=1e-5)
    expected = stepped_weights(tmp_path / "single", "siamese")
    got = stepped_weights(tmp_path / "cp2-dp2", "siamese")
    for name, value in got.items():
        err = (value - expected[name]).abs().max().item()
        assert err <= 1e-6, (name, err)


# Experts in every other block (block 0 MoE, block 1 dense, ...) beside a shared expert, the
# balancing and z losses on.
EXPERTS = dict(num_experts=4, moe_router_topk=2, moe_layer_freq=2,
               moe_shared_expert_intermediate_size=32, moe_z_loss_coeff=1e-3)
# Low enough that the step is clipped, so a gradient norm that missed or doubled the other
# rank's experts would scale every update.
EXPERT_CLIP = 0.05


@pytest.mark.slow
def test_sharded_optimizer_step_with_experts_matches_single_process(single_rank, tmp_path):
    """With the distributed optimizer and a clipped step, these take the one-process step:
    DP=2 (every expert on both ranks, its optimizer state sharded over megatron's expert
    data-parallel group, here the data-parallel ranks), TP=2 with the experts split like the
    rest (parallel.etp = tp), EP=2 (half the experts on each rank, the rest data-parallel:
    the gradient norm sums both halves of the experts) and TP=2 with whole experts
    (parallel.etp 1: each expert on both ranks, its gradient averaged and its optimizer state
    sharded over the expert data-parallel group)."""
    torch.manual_seed(11)
    [model] = build_model(tiny_model("siamese", **EXPERTS), ParallelConfig())
    weights.save([model], str(tmp_path / "weights"))
    runs = {"single": (1, {}), "dp2": (2, {}), "tp2": (2, {"tp": 2, "sequence_parallel": True}),
            "ep2": (2, {"ep": 2}),
            "tp2-etp1": (2, {"tp": 2, "sequence_parallel": True, "etp": 1})}
    for name, (world, layout) in runs.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / "weights").symlink_to(tmp_path / "weights")
        spawn(world, run_optimizer_step, "siamese", str(folder), world > 1, layout, EXPERTS,
              EXPERT_CLIP)
    norms = {name: json.loads((tmp_path / name / "grad_norm.json").read_text())
             for name in runs}
    assert norms["single"] > 2 * EXPERT_CLIP, norms  # the step is clipped
    before = {n: p.detach() for n, p in model.named_parameters()}
    expected = stepped_weights(tmp_path / "single", "siamese", EXPERTS)
    assert any(".experts." in name for name in expected)
    for name in ("dp2", "tp2", "ep2", "tp2-etp1"):
        assert norms[name] == pytest.approx(norms["single"], rel=1e-5), (name, norms)
        got = stepped_weights(tmp_path / name, "siamese", EXPERTS)
        worst = 0.0
        for key, value in got.items():
            assert not torch.equal(expected[key], before[key]), f"{key} did not move"
            err = (value - expected[key]).abs().max().item()
            assert err <= 1e-6, (name, key, err)
            worst = max(worst, err)
        print(f"\n{name} with experts: grad norm {norms[name]:.6g} (one process "
              f"{norms['single']:.6g}), largest weight difference {worst:.1e}")
