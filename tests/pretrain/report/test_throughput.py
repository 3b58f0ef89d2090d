"""Model FLOPs, peak TFLOP/s and MFU, against hand computations; the device helper; the
training step's one-reduction status; run.deterministic's settings."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from pretrain.config import load_config
from pretrain.report import throughput
from pretrain.report.throughput import Throughput, flops_per_token, peak_tflops
from pretrain.train.loop import step_status
from runtime import device
from tests.pretrain_fixtures import REPO, env

PAPER_1_3B = ["--model.num_layers=16", "--model.hidden_size=2048",
              "--model.num_attention_heads=32", "--model.num_query_groups=8",
              "--model.ffn_hidden_size=8192", "--model.vocab_size=50304",
              "--model.seq_length=4096"]


def test_flops_at_the_paper_shape_match_megatron_lms_expression():
    """Megatron-LM writes the same count as 12 L h^2 (1 + g/a + s/h + 3f/2h) + 6 h V
    (its num_floating_point_operations with GQA and SwiGLU); 8.07 GFLOP per token here, where
    6 x parameters + 12 L h s would give 8.69 (it counts the embedding lookup)."""
    config = load_config(None, PAPER_1_3B)
    L, h, a, g, f, s, V = 16, 2048, 32, 8, 8192, 4096, 50304
    expected = 12 * L * h * h * (1 + g / a + s / h + 1.5 * f / h) + 6 * h * V
    assert flops_per_token(config) == pytest.approx(expected, rel=1e-12)
    assert round(flops_per_token(config) / 1e9, 2) == 8.07


def test_flops_of_a_small_mha_gelu_model_counted_by_hand():
    """2 layers, h 64, 4 heads (no GQA), GeLU MLP 256, seq 32, vocab 512: per layer forward,
    QKV 2*64*192 + projection 2*64*64 + scores 2*32*64 + context 2*32*64 + fc1 and fc2
    2*64*256 each = 106,496; output layer 2*64*512 = 65,536; times 3 for training."""
    config = load_config(None, [
        "--model.num_layers=2", "--model.hidden_size=64", "--model.num_attention_heads=4",
        "--model.ffn_hidden_size=256", "--model.activation=gelu", "--model.seq_length=32",
        "--model.vocab_size=512"])
    assert flops_per_token(config) == 3 * (2 * 106_496 + 65_536)


MOE_15B = ["--config", "configs/paper/moe/siamese-lr1e-3.toml"]


def test_moe_flops_count_the_experts_a_token_runs_through():
    """Megatron-LM's MoE terms: per MoE block the k routed experts and the shared expert,
    3 SwiGLU matrices each; per dense block the dense MLP. 4 blocks of h 64, 4 heads / 2 KV
    groups, seq 32, vocab 512 (padded to 512), blocks 0 and 2 MoE with 8 experts of width 48,
    top-2, shared expert 96; blocks 1 and 3 dense, SwiGLU 256. Per block forward: Q and
    projection 2*64*64 each, K and V 2*64*32 each, scores and context 2*32*64 each; MoE MLP
    2*3*64*(2*48 + 96), dense MLP 2*3*64*256; output layer 2*64*512; times 3 for training.
    The 6 routed experts a token skips cost nothing."""
    shape = ["--model.num_layers=4", "--model.hidden_size=64", "--model.num_attention_heads=4",
             "--model.num_query_groups=2", "--model.ffn_hidden_size=256",
             "--model.seq_length=32", "--model.vocab_size=512", "--model.num_experts=8",
             "--model.moe_router_topk=2", "--model.moe_ffn_hidden_size=48",
             "--model.moe_shared_expert_intermediate_size=96", "--model.moe_layer_freq=2"]
    config = load_config(None, shape)
    attention = 2 * 2 * 64 * 64 + 2 * 2 * 64 * 32 + 2 * 2 * 32 * 64
    moe, dense = 2 * 3 * 64 * (2 * 48 + 96), 2 * 3 * 64 * 256
    assert flops_per_token(config) == 3 * (4 * attention + 2 * moe + 2 * dense + 2 * 64 * 512)
    more = load_config(None, [*shape, "--model.num_experts=64"])
    assert flops_per_token(more) == flops_per_token(config)  # more experts, same k: same cost


def test_moe_preset_flops_match_megatron_lms_expression_and_drive_mfu(monkeypatch):
    """The paper MoE preset by Megatron-LM's own expression (its num_floating_point_operations
    for GQA, SwiGLU, MoE with a shared expert): 12 L h^2 (1 + g/a + s/h) + 6 L h 3 (k f_e + f_s)
    + 6 h V, 13.60 GFLOP per token; the training's TFLOP/s and MFU are over this count."""
    config = load_config(*MOE_15B[1:])
    L, h, a, g, s, V = 24, 2048, 32, 8, 4096, 50304
    k, f_e, f_s = 8, 1024, 2048
    expected = 12 * L * h * h * (1 + g / a + s / h) + 6 * L * h * 3 * (k * f_e + f_s) + 6 * h * V
    assert flops_per_token(config) == pytest.approx(expected, rel=1e-12)
    assert round(flops_per_token(config) / 1e9, 2) == 13.60
    monkeypatch.setattr(device, "uses_cuda", lambda: True)
    monkeypatch.setattr(device, "device_name", lambda: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(device, "peak_memory_gib", lambda: 1.0)
    monkeypatch.setattr(throughput.dist, "get_world_size", lambda: 8)
    rates = Throughput(config).measure(10.0)
    tokens = 1024 * 4096
    assert rates["mfu"] == pytest.approx(expected * tokens / 10.0 / 8 / 1e12 / 989.0)


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0), ("NVIDIA GH200 480GB", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA A100 80GB PCIe", 312.0), ("NVIDIA B200", 2250.0),
    ("NVIDIA GeForce RTX 4090", None), ("Tesla V100-SXM2-32GB", None),
])
def test_peak_by_exact_device(name, peak):
    assert peak_tflops(name) == peak


def test_mfu_uses_the_override_and_is_absent_for_an_unknown_device(monkeypatch):
    monkeypatch.setattr(device, "uses_cuda", lambda: True)
    monkeypatch.setattr(device, "device_name", lambda: "NVIDIA GeForce RTX 4090")
    assert Throughput(load_config(None, [])).peak is None
    assert Throughput(load_config(None, ["--logging.peak_tflops=165"])).peak == 165.0
    monkeypatch.setattr(device, "device_name", lambda: "NVIDIA H100 PCIe")
    assert Throughput(load_config(None, [])).peak == 756.0
    monkeypatch.setattr(throughput.dist, "get_world_size", lambda: 1)
    monkeypatch.setattr(device, "peak_memory_gib", lambda: 1.5)
    config = load_config(None, [])
    rates = Throughput(config).measure(2.0)
    tokens = config.data.global_batch_size * config.seq_length
    assert rates["tokens_per_s"] == tokens / 2.0
    assert rates["tflops_per_gpu"] == pytest.approx(flops_per_token(config) * tokens / 2e12)
    assert rates["mfu"] == pytest.approx(rates["tflops_per_gpu"] / 756.0)


def test_device_helper_follows_cuda(monkeypatch):
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert device.compute_device().type == expected
    assert device.distributed_backend() == ("nccl" if expected == "cuda" else "gloo")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK \(1\) needs a GPU of its own but this "
                                           r"node shows 1"):
        device.select()


def _chunk(*grads: torch.Tensor):
    return SimpleNamespace(buffers=[SimpleNamespace(grad_data=g) for g in grads])


def test_step_status_agrees_loss_finiteness_and_stop_in_one_reduction(single_rank, device):
    ok = _chunk(torch.ones(4, device=device), torch.zeros(3, device=device))
    losses = [torch.tensor(2.0, device=device), torch.tensor(4.0, device=device)]
    calm = SimpleNamespace(requested=False)
    assert step_status(losses, [ok], calm) == (3.0, True, False)
    bad = _chunk(torch.tensor([1.0, float("inf")], device=device))
    assert step_status(losses, [ok, bad], calm) == (3.0, False, False)
    nan_loss = [torch.tensor(float("nan"), device=device)]
    assert step_status(nan_loss, [ok], calm).finite is False
    assert step_status(losses, [ok], SimpleNamespace(requested=True)).stop is True


@pytest.mark.slow
def test_make_deterministic_sets_every_switch():
    probe = ("import os, torch; from runtime import device; device.make_deterministic(); "
             "print(os.environ['CUBLAS_WORKSPACE_CONFIG'], os.environ['NCCL_ALGO'], "
             "os.environ['NVTE_ALLOW_NONDETERMINISTIC_ALGO'], "
             "torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic, "
             "torch.backends.cudnn.benchmark)")
    quiet = {k: v for k, v in env().items() if k not in ("CUBLAS_WORKSPACE_CONFIG", "NCCL_ALGO")}
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=quiet,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [":4096:8", "Ring", "0", "True", "True", "False"]
