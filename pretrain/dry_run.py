"""``train --dry-run``: the resolved config, sizes and parallel layout, without training."""

from __future__ import annotations

import os

import torch

from model import parallel
from model.builder import build_model, count_parameters
from model.config import ParallelConfig
from pretrain.config import Config, validate
from pretrain.rundir import to_toml


def _human(n: float) -> str:
    for unit in ("", "K", "M", "B", "T"):
        if abs(n) < 1000:
            return f"{n:.2f}{unit}" if unit else f"{n:.0f}"
        n /= 1000
    return f"{n:.2f}P"


def dry_run(config: Config, world_size: int | None = None) -> str:
    """World size: ``world_size``, else $WORLD_SIZE, else one data-parallel replica."""
    p, d, m = config.parallel, config.data, config.model
    world = world_size or int(os.environ.get("WORLD_SIZE", p.tp * p.pp))
    validate(config, world_size=world)
    parallel.initialize(ParallelConfig(), seed=config.run.seed)
    with torch.device("meta"):  # shapes only: a 1.3B model costs no memory here
        params = count_parameters(build_model(m, ParallelConfig()))
    parallel.destroy()
    dp = world // (p.tp * p.pp)
    tokens_per_step = d.global_batch_size * config.seq_length
    # Per GPU: bf16 weights (2 B) + fp32 grads (4 B) + fp32 main weights and Adam moments
    # (12 B, divided over DP with the distributed optimizer).
    per_gpu_params = params / (p.tp * p.pp)
    state_bytes = 12 / (dp if p.distributed_optimizer else 1)
    weights_gb = per_gpu_params * (2 + 4 + state_bytes) / 2**30
    lines = [
        to_toml(config).rstrip(),
        "",
        f"parameters: {params:,} ({_human(params)})",
        f"layout: world {world} = tp {p.tp} x pp {p.pp} x dp {dp}"
        + (f", {p.vp} virtual stages per pipeline rank" if p.vp else "")
        + (", sequence parallel" if p.sequence_parallel else "")
        + f", recompute {p.recompute}",
        f"micro-batches per step: {d.global_batch_size // (d.micro_batch_size * dp)} "
        f"of {d.micro_batch_size} sequences per data-parallel rank",
        f"tokens per step: {tokens_per_step:,}; steps: {config.run.steps:,}; "
        f"total tokens: {_human(tokens_per_step * config.run.steps)}",
        f"memory per GPU for weights, grads and optimizer state: {weights_gb:.1f} GiB "
        "(activations not included)",
    ]
    return "\n".join(lines)
