"""A run's first lines (pretrain.train.loop.announce) name a mixture of experts where a user
looks first: the experts, the top-k, the MoE blocks and the active parameters on the start
line, ep and etp on the layout line, in the dry run's words (one function,
pretrain.report.model_summary); a dense model's lines are as before. In-process, on the
demo's config, with the world size the layout line reads stubbed (no process group)."""

from __future__ import annotations

import pytest

from model.sizes import ParameterCount
from pretrain.config import load_config
from pretrain.train import loop
from tests.pretrain_fixtures import REPO

MOE = ["--model.num_experts=8", "--model.moe_router_topk=2", "--model.moe_ffn_hidden_size=96",
       "--model.moe_layer_freq=[1,0,1,0,1,1]", "--parallel.ep=2", "--data.micro_batch_size=8"]
TOTAL, ROUTED = 6_171_520, 4 * 8 * 3 * 128 * 96  # four MoE blocks of 8 experts of 3 h f_e


def first_lines(monkeypatch, overrides: list[str], world: int) -> list[str]:
    """The lines announce logs for the demo's config with ``overrides`` on ``world`` ranks."""
    config = load_config(str(REPO / "configs" / "demo-cpu.toml"), overrides)
    monkeypatch.setattr(loop.dist, "get_world_size", lambda: world)
    monkeypatch.setattr(loop.parallel_state, "get_data_parallel_world_size", lambda: world)
    lines: list[str] = []  # what announce logs, whatever another test did to logging
    monkeypatch.setattr(loop.log, "info", lambda message, *args: lines.append(message % args))
    loop.announce(config, ParameterCount(total=TOTAL, routed=ROUTED), 0, None)
    return lines


def test_an_moe_models_start_and_layout_lines_name_the_experts(monkeypatch):
    start, layout, *_ = first_lines(monkeypatch, MOE, world=4)
    active = TOTAL - ROUTED * 6 // 8  # a token skips 6 of each block's 8 experts
    assert start == (f"training siamese: 6,171,520 parameters (6 layers x 128, 4 heads, "
                     f"8 experts top-2 in 4 MoE blocks, {active:,} active per token), float32 "
                     "on cpu"), start
    assert layout.startswith("layout: world 4 = tp 1 x pp 1 x dp 4; experts: ep 2 x etp 1 x "
                             "pp 1 x expert dp 2; "), layout


@pytest.mark.parametrize("shared, words", [(0, ""), (64, " with a shared expert")])
def test_a_shared_expert_is_named(monkeypatch, shared, words):
    extra = [f"--model.moe_shared_expert_intermediate_size={shared}"] if shared else []
    start = first_lines(monkeypatch, MOE + extra, world=2)[0]
    assert f"8 experts top-2 in 4 MoE blocks{words}, " in start, start


def test_a_dense_models_lines_are_unchanged(monkeypatch):
    start, layout, *_ = first_lines(monkeypatch, [], world=2)
    assert start == "training siamese: 6,171,520 parameters (6 layers x 128, 4 heads), " \
        "float32 on cpu"
    assert layout == "layout: world 2 = tp 1 x pp 1 x dp 2; 1 micro-batch of 16 sequences " \
        "per step and data-parallel rank", layout
