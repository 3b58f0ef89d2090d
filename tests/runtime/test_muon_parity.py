"""Muon across layouts: TP=2 (each shard orthogonalised as part of its whole matrix, QKV and
the SwiGLU's halves per part), TP=2 with sequence parallelism (its marked parameters, the
norms, are AdamW's), PP=2 (each stage steps its own matrices, one gradient norm clipped
across stages), DP=2 under megatron's DDP and under the distributed optimizer (each rank
steps and keeps the momentum of the whole matrices it owns, the others' updates arrive by
all-gather), TP=2 x DP=2 and PP=2 x DP=2 under it, and experts under EP=2 (each expert a
matrix of its own) take one process's three steps (within 1e-5). The gradient norm (0.73) is
above the clip (0.5), so a Muon norm taken on one stage only misses by 2e-5 under PP=2."""

import json

import pytest
import torch

from model.builder import build_model
from model.config import ParallelConfig
from runtime import weights
from tests.helpers import spawn, tiny_model
from tests.muon_worker import run_muon_steps

SCHEME = "siamese"
EXPERTS = dict(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.1)


def take_steps(tmp_path, layouts: dict, model: dict | None = None) -> dict[str, list]:
    """Every layout's three steps from the same weights, each within 1e-5 of one process's
    ("one"); the names of the matrices whose momentum each rank kept, by layout."""
    torch.manual_seed(13)
    [reference] = build_model(tiny_model(SCHEME, **(model or {})), ParallelConfig())
    weights.save([reference], str(tmp_path / "weights"))
    for name, (world, layout) in layouts.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "weights").symlink_to(tmp_path / "weights")
        spawn(world, run_muon_steps, SCHEME, str(tmp_path / name), layout, model)

    def stepped(name: str) -> dict:
        [built] = build_model(tiny_model(SCHEME, **(model or {})), ParallelConfig())
        weights.load([built], str(tmp_path / name / "stepped"))
        return {n: p.detach().clone() for n, p in built.named_parameters()}

    before = {n: p.detach() for n, p in reference.named_parameters()}
    expected = stepped("one")
    for name in [name for name in layouts if name != "one"]:
        for key, value in stepped(name).items():
            assert not torch.equal(expected[key], before[key]), f"{key} did not move"
            err = (value - expected[key]).abs().max().item()
            assert err <= 1e-5, (name, key, err)
    return {name: [json.loads((tmp_path / name / f"momenta-{r}.json").read_text())
                   for r in range(world)] for name, (world, _) in layouts.items()}


def assert_owned_once(held: list[list[str]], everything: list[str], layout: str) -> None:
    assert all(held) and sorted(sum(held, [])) == everything, (
        f"{layout}: under the distributed optimizer each data-parallel rank must keep the "
        f"momenta of the matrices it owns, together each once: {held}")


@pytest.mark.slow
def test_tp_sp_pp_and_dp_take_one_process_muon_steps(single_rank, tmp_path):
    held = take_steps(tmp_path, {
        "one": (1, {}), "tp2": (2, {"tp": 2}), "dp2": (2, {}),
        "tp2-sp": (2, {"tp": 2, "sequence_parallel": True}), "pp2": (2, {"pp": 2}),
        "dp2-zero1": (2, {"distributed_optimizer": True}),
        "tp2-dp2-zero1": (4, {"tp": 2, "distributed_optimizer": True}),
        "pp2-dp2-zero1": (4, {"pp": 2, "distributed_optimizer": True})})
    [everything] = held["one"]
    assert held["dp2"] == [everything, everything]  # megatron's DDP: every rank steps all
    assert_owned_once(held["dp2-zero1"], everything, "dp2-zero1")
    # ranks 0 and 1 are the TP peers of DP rank 0, 2 and 3 those of DP rank 1
    tp_dp = held["tp2-dp2-zero1"]
    assert tp_dp[0] == tp_dp[1] and tp_dp[2] == tp_dp[3]
    assert_owned_once([tp_dp[0], tp_dp[2]], everything, "tp2-dp2-zero1")
    # each pipeline stage shares out its own blocks' matrices over its two data-parallel ranks
    # (a stage numbers its blocks from 0: the momenta are counted, not named, across stages)
    pp_dp = held["pp2-dp2-zero1"]
    assert all(pp_dp) and sum(len(r) for r in pp_dp) == len(everything), pp_dp


@pytest.mark.slow
def test_experts_take_one_process_muon_steps_under_expert_parallelism(single_rank, tmp_path):
    """Four experts (top-2): under EP=2 each rank steps its two experts' matrices, alone, as
    one process steps all four; under the distributed optimizer too, on two ranks (the expert
    data-parallel group is one rank) and on four (it is two)."""
    held = take_steps(tmp_path, {
        "one": (1, {}), "ep2": (2, {"ep": 2}),
        "ep2-zero1": (2, {"ep": 2, "distributed_optimizer": True}),
        "ep2-dp4-zero1": (4, {"ep": 2, "distributed_optimizer": True})}, EXPERTS)
    [everything] = held["one"]
    experts = [name for name in everything if ".experts." in name]
    dense = [name for name in everything if name not in experts]
    assert experts and dense, everything
    for layout in ("ep2", "ep2-zero1"):  # each rank's two experts, numbered 0 and 1 on it
        for rank in (0, 1):
            mine = [name for name in held[layout][rank] if ".experts." in name]
            assert len(mine) == len(experts) // 2, (layout, rank, mine)
    assert [sorted(set(r) - set(experts)) for r in held["ep2"]] == [dense, dense]
    # the expert data-parallel group is one rank: only the dense matrices are shared out
    assert_owned_once([sorted(set(r) & set(dense)) for r in held["ep2-zero1"]], dense,
                      "ep2-zero1")
    # four ranks: the dense matrices shared out over four, each expert over its two holders
    wide = held["ep2-dp4-zero1"]
    assert_owned_once([sorted(set(r) & set(dense)) for r in wide], dense, "ep2-dp4-zero1")
    assert sum(len(set(r) & set(experts)) for r in wide) == len(experts), wide
