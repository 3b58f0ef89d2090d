"""Muon across layouts: TP=2 (each shard orthogonalised as part of its whole matrix, QKV and
the SwiGLU's halves per part), TP=2 with sequence parallelism (its marked parameters, the
norms, are AdamW's), PP=2 (each stage steps its own matrices, one gradient norm clipped
across stages) and DP=2 take one process's three steps (within 1e-5). The gradient norm (0.73)
is above the clip (0.5), so a Muon norm taken on one stage only misses by 2e-5 under PP=2."""

import pytest
import torch

from model.builder import build_model
from model.config import ParallelConfig
from runtime import weights
from tests.helpers import spawn, tiny_model
from tests.muon_worker import run_muon_steps

SCHEME = "siamese"


def stepped(folder) -> dict:
    [model] = build_model(tiny_model(SCHEME), ParallelConfig())
    weights.load([model], str(folder / "stepped"))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.slow
def test_tp_sp_pp_and_dp_take_one_process_muon_steps(single_rank, tmp_path):
    torch.manual_seed(13)
    [model] = build_model(tiny_model(SCHEME), ParallelConfig())
    weights.save([model], str(tmp_path / "weights"))
    layouts = {"one": (1, {}), "tp2": (2, {"tp": 2}), "dp2": (2, {}),
               "tp2-sp": (2, {"tp": 2, "sequence_parallel": True}), "pp2": (2, {"pp": 2})}
    for name, (world, layout) in layouts.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "weights").symlink_to(tmp_path / "weights")
        spawn(world, run_muon_steps, SCHEME, str(tmp_path / name), layout)
    before = {n: p.detach() for n, p in model.named_parameters()}
    expected = stepped(tmp_path / "one")
    for name in [name for name in layouts if name != "one"]:
        got = stepped(tmp_path / name)
        for key, value in got.items():
            assert not torch.equal(expected[key], before[key]), f"{key} did not move"
            err = (value - expected[key]).abs().max().item()
            assert err <= 1e-5, (name, key, err)
