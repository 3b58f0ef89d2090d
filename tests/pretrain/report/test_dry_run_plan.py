"""The dry run plans a run on GPU nodes wherever it runs: a login node without CUDA must not
estimate a run without the fusions ``model.megatron_fusions = "auto"`` turns on there (the
paper's MoE preset at 8 GPUs read 54.3 GiB on the CPU, 49.8 on the nodes), and the report says
which fusions it counted. A world size the layout cannot take still shows the plan up to the
layout. In-process, with a fixed parameter count: the count (a model build) is
tests/pretrain/report/test_dry_run.py's; the CLI's refusal is run there too."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from model.backends import TransformerImpl
from model.sizes import ParameterCount
from pretrain.config import load_config
from pretrain.report import dry_run as plan
from pretrain.report.dry_run import Fusions, LayoutRefused, activation_bytes, dry_run
from runtime import device
from tests.pretrain.report.test_dry_run_memory import PAPER_1_3B

SHAPE = [*PAPER_1_3B, "--data.micro_batch_size=2", "--data.global_batch_size=16"]


@pytest.fixture
def counted(monkeypatch):
    """A fixed parameter count: no model build, no process group."""
    monkeypatch.setattr(plan, "parameter_count",
                        lambda model, seed: (ParameterCount(total=10_000, routed=0), 0))


@pytest.fixture
def login_node(monkeypatch):
    """This process as a machine without CUDA, as a login node is (on a GPU host too)."""
    monkeypatch.setattr(device, "uses_cuda", lambda: False)


def _fusions_and_activations(report: str) -> tuple[str, float]:
    line = next(s for s in report.splitlines() if s.startswith("megatron fusions counted"))
    return line, float(re.search(r"activations \(estimate\): ([\d.]+) GiB", report).group(1))


def test_auto_fusions_are_estimated_as_on_the_gpu_nodes_and_named(counted, login_node):
    reports = {choice: dry_run(load_config(None, [*SHAPE, f"--model.megatron_fusions={choice}"]),
                               world_size=8)
               for choice in ("auto", "on", "off")}
    auto, on, off = (_fusions_and_activations(reports[c]) for c in ("auto", "on", "off"))
    assert auto[1] == on[1] < off[1], (auto, on, off)
    # SwiGLU keeps 3f less per token, the bf16 cross entropy one fp32 copy of the logits more;
    # RoPE's fusion is Transformer Engine's, which the config does not ask for
    assert auto[0] == ("megatron fusions counted (model.megatron_fusions auto: on, as on the GPU "
                       "nodes): fused SwiGLU and cross entropy, unfused RoPE (Transformer "
                       "Engine's fusion: counted with te linears or attention only)")
    assert on[0].startswith("megatron fusions counted (model.megatron_fusions on): fused SwiGLU")
    assert off[0] == ("megatron fusions counted (model.megatron_fusions off): unfused SwiGLU and "
                      "cross entropy and RoPE")


def test_the_estimate_counts_the_fusions_of_the_gpu_run(login_node):
    """The estimate's own default (no fusions given) is the GPU run's: auto fusions on, the
    auto dtype bf16 (its cross entropy fused), RoPE fused only with Transformer Engine asked
    for, and never with positions per token (``data.reset_position_ids``)."""
    config = load_config(None, SHAPE)
    assert Fusions.planned(config) == Fusions(activation=True, cross_entropy=True)
    assert activation_bytes(config, dp=8) == activation_bytes(
        config, dp=8, fusions=Fusions(activation=True, cross_entropy=True))
    fp32 = load_config(None, [*SHAPE, "--run.params_dtype=fp32"])
    assert Fusions.planned(fp32) == Fusions(activation=True)
    # a config asking for TE is refused on a machine without it, so it is built here directly
    te = replace(config, model=replace(config.model, transformer_impl=TransformerImpl.TE))
    assert Fusions.planned(te) == Fusions(activation=True, cross_entropy=True, rope=True)
    per_token = replace(te, data=replace(te.data, reset_position_ids=True))
    assert not Fusions.planned(per_token).rope


def test_a_world_the_layout_cannot_take_shows_the_plan_up_to_the_layout(counted):
    config = load_config("configs/demo-cpu.toml", ["--parallel.tp=2"])
    with pytest.raises(LayoutRefused) as refused:
        dry_run(config, world_size=3)
    assert "world size (3)" in str(refused.value) and "parallel.tp" in str(refused.value)
    shown = refused.value.plan
    assert "[parallel]\ntp = 2" in shown and "parameters: 10,000" in shown
    assert "tokens per step: 4,096" in shown and "model FLOPs per token" in shown
    # 32 sequences per step in micro-batches of 16: dp 1 or 2, so 2 or 4 ranks of tp 2
    assert shown.splitlines()[-1] == ("layout: tp 2 x pp 1; world 3 does not fit it "
                                      "(below); world sizes it takes: 2, 4")
    assert "memory per GPU" not in shown  # needs a layout
