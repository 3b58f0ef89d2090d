"""``train --dry-run``: the resolved config, sizes and parallel layout, without training."""

from __future__ import annotations

import os

import torch

from kernels.backend import NormBackend
from model.builder import build_model, count_parameters
from model.config import ModelConfig, ParallelConfig
from model.schemes import Recompute
from pretrain.config import Config, validate
from pretrain.rundir import to_toml
from pretrain.throughput import flops_per_token
from runtime import cpu_compat, parallel


def human(n: float) -> str:
    for unit in ("", "K", "M", "B", "T"):
        if abs(n) < 1000:
            return f"{n:.2f}{unit}" if unit else f"{n:.0f}"
        n /= 1000
    return f"{n:.2f}P"




def _layer_elements(m: ModelConfig, tp: int, sequence_parallel: bool) -> float:
    """Values one transformer layer keeps for backward, per token (after Korthikanti et al.,
    "Reducing Activation Recomputation in Large Transformer Models", without dropout, and
    with fused attention, which keeps no s x s score matrix). Attention: norm input, QKV input,
    Q, K, V, context; MLP: norm input, fc1 input, fc1 output (two-wide for SwiGLU), activation
    output. The two-stream schemes keep both streams and their three norms' outputs per
    sublayer: about 4h more per sublayer. Norm-side values split over TP only with sequence
    parallelism; the rest always does."""
    h, f = m.hidden_size, m.ffn_size
    kv = m.kv_heads * (h // m.num_attention_heads)
    fc1 = 2 * f if m.activation == "swiglu" else f
    per_token_norms = 2 * h + (8 * h if m.residual_scheme.traits.two_stream else 0)
    sharded = 2 * h + h + 2 * kv + h + fc1 + f
    return per_token_norms / (tp if sequence_parallel else 1) + sharded / tp


def activation_bytes(config: Config, dp: int) -> float:
    """Activation memory of the busiest GPU in one step: the first pipeline stage holds up to
    pp micro-batches in flight (1F1B), i.e. about all layers' activations of one micro-batch;
    full recomputation keeps only each layer's input plus one layer being recomputed. The
    last stage adds fp32 logits and their gradient. An estimate, good to tens of percent."""
    m, p, d = config.model, config.parallel, config.data
    tokens = config.seq_length * d.micro_batch_size
    width = 2 if config.run.params_dtype != "fp32" else 4
    layer = _layer_elements(m, p.tp, p.sequence_parallel)
    layers_per_stage = m.num_layers // p.pp
    in_flight = min(p.pp, max(1, d.global_batch_size // (d.micro_batch_size * dp)))
    if p.recompute is Recompute.FULL:
        streams = 2 if m.residual_scheme.traits.two_stream else 1
        kept = layers_per_stage * streams * m.hidden_size / (p.tp if p.sequence_parallel else 1)
        per_microbatch = kept + layer
    else:
        per_microbatch = layers_per_stage * layer
    logits = 2 * 4 * m.padded_vocab_size / p.tp
    return tokens * (in_flight * per_microbatch * width + (logits if p.pp == 1 else 0))


def parameter_count(model: ModelConfig, seed: int) -> int:
    """Parameters of the whole model, from a build on the meta device (shapes only: a 1.3B
    model costs no memory) in a one-rank group opened and closed here."""
    with cpu_compat.enabled():
        parallel.initialize(ParallelConfig(), seed=seed)
        try:
            with torch.device("meta"):
                return count_parameters(build_model(model, ParallelConfig(),
                                                    norm_backend=NormBackend.TORCH))
        finally:
            parallel.destroy()


def dry_run(config: Config, world_size: int | None = None) -> str:
    """World size: ``world_size``, else $WORLD_SIZE, else one data-parallel replica."""
    p, d, m = config.parallel, config.data, config.model
    world = world_size or int(os.environ.get("WORLD_SIZE", p.tp * p.pp))
    validate(config, world_size=world)
    params = parameter_count(m, config.run.seed)
    dp = world // (p.tp * p.pp)
    tokens_per_step = d.global_batch_size * config.seq_length
    # Per GPU: bf16 weights (2 B) + fp32 grads (4 B) + fp32 main weights and Adam moments
    # (12 B, divided over DP with the distributed optimizer).
    per_gpu_params = params / (p.tp * p.pp)
    state_bytes = 12 / (dp if p.distributed_optimizer else 1)
    weights_gb = per_gpu_params * (2 + 4 + state_bytes) / 2**30
    activations_gb = activation_bytes(config, dp) / 2**30
    lines = [
        to_toml(config).rstrip(),
        "",
        f"parameters: {params:,} ({human(params)})",
        f"layout: world {world} = tp {p.tp} x pp {p.pp} x dp {dp}"
        + (f", {p.vp} virtual stages per pipeline rank" if p.vp else "")
        + (", sequence parallel" if p.sequence_parallel else "")
        + f", recompute {p.recompute}",
        f"micro-batches per step: {d.global_batch_size // (d.micro_batch_size * dp)} "
        f"of {d.micro_batch_size} sequences per data-parallel rank",
        f"tokens per step: {tokens_per_step:,}; steps: {config.run.steps:,}; "
        f"total tokens: {human(tokens_per_step * config.run.steps)}",
        f"model FLOPs per token (forward + backward, Megatron-LM's formula): "
        f"{flops_per_token(config) / 1e9:.2f} GFLOP; per step: "
        f"{flops_per_token(config) * tokens_per_step / 1e12:,.1f} TFLOP",
        f"memory per GPU for weights, grads and optimizer state: {weights_gb:.1f} GiB",
        f"memory per GPU for activations (estimate): {activations_gb:.1f} GiB; "
        f"total about {weights_gb + activations_gb:.1f} GiB",
    ]
    return "\n".join(lines)
