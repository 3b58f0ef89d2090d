"""Tokens per second, and on GPU model TFLOP/s per GPU, MFU and peak memory."""

from __future__ import annotations

import torch
import torch.distributed as dist

from pretrain.config import Config

# Dense bf16 peak TFLOP/s of the accelerators MFU is reported for.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "B200": 2250.0}


def flops_per_token(config: Config, parameters: int) -> float:
    """Training FLOPs per token: 6 per parameter plus attention scores (12 L h s)."""
    m = config.model
    return 6.0 * parameters + 12.0 * m.num_layers * m.hidden_size * config.seq_length


class Throughput:
    def __init__(self, config: Config, parameters: int):
        self.tokens_per_step = config.data.global_batch_size * config.seq_length
        self.flops_per_step = flops_per_token(config, parameters) * self.tokens_per_step
        self.peak = None
        if torch.cuda.is_available():
            name = torch.cuda.get_device_name()
            self.peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)

    def measure(self, seconds: float) -> dict:
        out = {"tokens_per_s": self.tokens_per_step / seconds}
        if torch.cuda.is_available():
            tflops = self.flops_per_step / seconds / dist.get_world_size() / 1e12
            out["tflops_per_gpu"] = tflops
            if self.peak:
                out["mfu"] = tflops / self.peak
            out["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
        return out
