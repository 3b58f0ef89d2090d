"""The dry run's weights, gradients and optimizer state per GPU, with and without experts,
against hand computations (the activation estimate is tests/pretrain/report/
test_dry_run_memory.py's)."""

import pytest

from model.sizes import ParameterCount
from pretrain.config import load_config
from pretrain.report.dry_run import state_bytes_per_gpu

SMALL = ["--model.num_layers=4", "--model.hidden_size=32", "--model.num_attention_heads=4",
         "--model.seq_length=16", "--data.micro_batch_size=1", "--data.global_batch_size=32",
         "--data.valid_samples=0"]
MOE = [*SMALL, "--model.num_experts=8"]


@pytest.mark.parametrize("overrides, world, expected", [
    # dense: 10,000 parameters over dp 16: 2 + 4 + 12 / 16 bytes each
    (SMALL, 16, 10_000 * 6.75),
    # without the distributed optimizer every rank keeps the whole state: 18 bytes each
    ([*SMALL, "--parallel.distributed_optimizer=false"], 16, 10_000 * 18),
    # experts over ep 4 (expert dp 16 / 4 = 4), the rest over dp 16
    ([*MOE, "--parallel.ep=4"], 16, 2_000 * 6.75 + 8_000 / 4 * 9),
    # tp 2 splits the rest (dp 8), etp 1 keeps experts whole: 4 expert ranks, expert dp 4
    ([*MOE, "--parallel.ep=4", "--parallel.tp=2", "--parallel.etp=1",
      "--parallel.sequence_parallel=true"], 16, 2_000 / 2 * 7.5 + 8_000 / 4 * 9),
    # pp 2 splits both: 2 x 2 expert ranks per replica, expert dp 16 / 4 = 4
    ([*MOE, "--parallel.ep=2", "--parallel.pp=2"], 16, 2_000 / 2 * 7.5 + 8_000 / 4 * 9),
    ([*MOE, "--parallel.ep=2", "--parallel.distributed_optimizer=false"], 16,
     2_000 * 18 + 8_000 / 2 * 18),
])
def test_state_bytes_split_dense_and_expert_parameters(overrides, world, expected):
    config = load_config(None, overrides, world_size=world)
    routed = 8_000 if config.model.num_experts else 0
    count = ParameterCount(total=10_000, routed=routed)
    assert state_bytes_per_gpu(config, count, world) == pytest.approx(expected, rel=1e-12)


def test_muon_keeps_one_momentum_for_the_matrices_it_steps():
    """optim.name muon: 6,000 of 10,000 parameters are block matrices, each with a main weight
    and one momentum (2 + 4 + 8 bytes), the rest AdamW's (2 + 4 + 12); an AdamW run of the same
    model counts Adam's state for all. Under the distributed optimizer (dp 4) both states are
    shared out; with experts (8,000 routed, 7,000 of them expert matrices, ep 4: expert dp 1)
    each rank keeps its experts' whole state."""
    count, muon = ParameterCount(total=10_000, routed=0), ParameterCount(total=6_000, routed=0)
    whole = load_config(None, [*SMALL, "--optim.name=muon",
                               "--parallel.distributed_optimizer=false"], world_size=4)
    adamw = load_config(None, [*SMALL, "--parallel.distributed_optimizer=false"], world_size=4)
    assert state_bytes_per_gpu(whole, count, 4, muon) == 4_000 * 18 + 6_000 * 14
    assert state_bytes_per_gpu(adamw, count, 4, muon) == 10_000 * 18
    sharded = load_config(None, [*SMALL, "--optim.name=muon"], world_size=4)
    assert state_bytes_per_gpu(sharded, count, 4, muon) == 4_000 * (6 + 3) + 6_000 * (6 + 2)
    experts = load_config(None, [*MOE, "--optim.name=muon", "--parallel.ep=4"], world_size=4)
    count, muon = ParameterCount(10_000, routed=8_000), ParameterCount(9_000, routed=7_000)
    assert state_bytes_per_gpu(experts, count, 4, muon) == pytest.approx(
        0 * 9 + 2_000 * (6 + 2) + 1_000 / 4 * 18 + 7_000 / 4 * 14, rel=1e-12)


def test_the_moe_presets_state_on_8_32_and_64_gpus():
    """The paper MoE preset (15,260,227,584 parameters, 14,495,514,624 of them routed experts;
    ep 8): at 8 GPUs each rank holds the whole optimizer state of its 12 experts (expert dp 1),
    so the state shrinks as the expert data-parallel ranks grow (docs/moe.md's layouts)."""
    config = load_config("configs/paper/moe/siamese-lr1e-3.toml")
    count = ParameterCount(total=15_260_227_584, routed=14_495_514_624)
    gib = [round(state_bytes_per_gpu(config, count, world) / 2**30, 1) for world in (8, 32, 64)]
    assert gib == [35.7, 19.7, 17.1]
