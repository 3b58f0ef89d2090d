"""Tokens per second, and on GPU model TFLOP/s per GPU, MFU and peak memory.

Model FLOPs are counted as Megatron-LM counts them for its published MFU figures, so numbers
compare with theirs: only matrix products, each done three times (forward, and the backward's
data and weight gradients), at 2 FLOPs per multiply-add. Per token and layer: the Q and output
projections (2 h^2 each with h = heads x head_dim), the K and V projections (2 h kv each), the
attention scores and their use on V (2 x 2 s h, no discount for the causal mask), and the MLP
(2 h f per matrix, three matrices for SwiGLU, two otherwise); once per token the output layer
(2 h V). The input-embedding lookup is not a product and costs nothing. The norms, residual
updates and SiameseNorm's second stream are not products either: a scheme changes the time per
token, never the FLOPs per token, so MFU compares schemes as throughput does.

A mixture-of-experts block's MLP counts what a token runs through, as Megatron-LM's
``num_floating_point_operations`` does: the k routed experts it is sent to (2 h f_e per matrix
each) and the shared expert (2 h f_s per matrix), so MFU is over the active parameters, not the
total. Like Megatron-LM it leaves out the router's product (2 h E per token and MoE block, E the
routed experts; 0.2% of the paper MoE preset's count) and the token dispatch, which moves
tokens without multiplying them.
"""

from __future__ import annotations

import re

import torch.distributed as dist

from model.config import Activation
from pretrain.config import Config
from runtime import device

# Dense (no sparsity) bf16 peak TFLOP/s by device name, most specific pattern first. An
# unlisted device gets no MFU (set logging.peak_tflops) rather than a wrong one.
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    (r"H100.*PCIe", 756.0),
    (r"H100.*NVL", 835.0),
    (r"H200.*NVL", 835.0),
    (r"GH200", 989.0),
    (r"H100", 989.0),  # SXM5 ("NVIDIA H100 80GB HBM3")
    (r"H200", 989.0),
    (r"A100", 312.0),
    (r"B200", 2250.0),
)


def peak_tflops(device_name: str) -> float | None:
    """Dense bf16 peak of a device from its name, or None when it is not known."""
    for pattern, peak in PEAK_TFLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return peak
    return None


def flops_per_token(config: Config) -> float:
    """Training FLOPs per token (forward + backward) by Megatron-LM's formula; the dry run's
    figure and the training's TFLOP/s and MFU both come from here."""
    m, s = config.model, config.seq_length
    h = m.hidden_size  # = heads x head_dim here (kv_channels = hidden_size / heads)
    kv = m.kv_heads * (h // m.num_attention_heads)
    mlp_matrices = 3 if m.activation is Activation.SWIGLU else 2
    moe_blocks = sum(m.moe_blocks)
    # the MLP widths a token passes through, summed over the blocks
    mlp_width = (m.num_layers - moe_blocks) * m.ffn_size + moe_blocks * (
        m.moe_router_topk * m.moe_expert_ffn_size + (m.moe_shared_expert_intermediate_size or 0))
    attention = 2 * h * h + 2 * h * kv + 2 * s * h
    forward = 2 * (m.num_layers * attention + mlp_matrices * h * mlp_width
                   + h * m.padded_vocab_size)
    return 3.0 * forward


class Throughput:
    """Turns a step's wall time into the logged speed metrics."""

    def __init__(self, config: Config):
        self.tokens_per_step = config.data.global_batch_size * config.seq_length
        self.flops_per_step = flops_per_token(config) * self.tokens_per_step
        self.peak = None
        if device.uses_cuda():
            self.peak = config.logging.peak_tflops or peak_tflops(device.device_name())

    def measure(self, seconds: float) -> dict:
        out = {"tokens_per_s": self.tokens_per_step / seconds}
        if device.uses_cuda():
            tflops = self.flops_per_step / seconds / dist.get_world_size() / 1e12
            out["tflops_per_gpu"] = tflops
            if self.peak:
                out["mfu"] = tflops / self.peak
            out["peak_memory_gb"] = device.peak_memory_gib()
        return out
