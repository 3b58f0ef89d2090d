"""Rank entry points for the parallel-parity tests (run through tests.helpers.spawn)."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

from kernels.norms import Norm
from model.builder import build_model, model_parameters, wrap_ddp
from model.config import ParallelConfig
from model.layers.two_stream import TwoStreamLayer
from runtime import parallel, weights
from runtime.schedule import forward_backward
from tests.helpers import MBS, SEQ, batches, tiny_model

MICROBATCHES = 4


def grads_into_params(chunks) -> None:
    """Replace each weight by its gradient so a checkpoint of the model stores the grads."""
    with torch.no_grad():
        for chunk in chunks:
            for param in chunk.module.parameters():
                param.copy_(param.main_grad)


def record_depth_scales(chunks, folder: str) -> None:
    """Write {global block index: c_l} for the two-stream blocks this rank holds."""
    scales = {
        layer.layer_number - 1: layer.c
        for chunk in chunks for layer in chunk.module.decoder.layers
        if isinstance(layer, TwoStreamLayer)
    }
    with open(os.path.join(folder, f"depth_scales.rank{dist.get_rank()}.json"), "w") as f:
        json.dump(scales, f)


def mean_loss(chunks) -> float | None:
    """This rank's data-parallel share of the parity batches through ``chunks``: the mean loss
    over every rank that holds one (the last pipeline stages), on rank 0; None elsewhere."""
    dp = parallel_state.get_data_parallel_world_size()
    mine = batches(MICROBATCHES)[parallel_state.get_data_parallel_rank()::dp]
    losses = [float(loss) for loss in forward_backward(chunks, mine, len(mine), SEQ, MBS)]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, losses)
    per_rank = [losses for losses in gathered if losses]
    return sum(map(sum, per_rank)) / sum(map(len, per_rank)) if dist.get_rank() == 0 else None


BALANCING_LOSSES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                    "global_aux_loss": "global_load_balancing_loss"}
"""megatron's tracker name of each balancing loss (model.moe_router_load_balancing_type)."""


def router_losses(model, microbatches: int) -> dict[str, float]:
    """The routers' balancing and z losses of the passes since the tracker was last cleared
    (megatron's MoE metrics tracker, without their coefficients), reduced as megatron's
    training loop reports them: summed over pipeline stages and over the tensor-parallel
    shards of a sequence, averaged over data-parallel ranks, micro-batches (``microbatches``
    on this rank) and MoE blocks. A collective: every rank calls it. Empty for a dense
    model."""
    if not model.num_experts:
        return {}
    balancing = BALANCING_LOSSES.get(model.moe_router_load_balancing_type)
    names = [name for name, coeff in ((balancing, model.moe_aux_loss_coeff),
                                      ("z_loss", model.moe_z_loss_coeff)) if name and coeff > 0]
    found: dict = {}
    get_moe_metrics_tracker().report(
        loss_scale=1 / microbatches, iteration=0, force_initialize=True, track_names=names,
        num_layers=model.num_layers, moe_layer_freq=model.moe_layer_freq,
        total_loss_dict=found)
    return {name: float(value) for name, value in found.items()}


def run_layout(layout: dict, schemes: list[str], workdir: str,
               model_overrides: dict | None = None, norm_backend: str = "torch",
               scheme_overrides: dict[str, dict] | None = None) -> None:
    """Load the reference weights into a sharded model, run one batch, save losses and grads.
    ``model_overrides`` are ModelConfig fields applied to every scheme's tiny model, and
    ``scheme_overrides`` those of one scheme on top; the model is built with
    ``norm_backend``, and the backends its norms hold are written down. A model with experts
    also writes its routers' losses (:func:`router_losses`)."""
    par = ParallelConfig(distributed_optimizer=False, **layout)
    parallel.initialize(par)
    for scheme in schemes:
        model = tiny_model(scheme, **(model_overrides or {}),
                           **(scheme_overrides or {}).get(scheme, {}))
        chunks = wrap_ddp(build_model(model, par, norm_backend=norm_backend), par)
        weights.load(chunks, os.path.join(workdir, scheme, "weights"))
        get_moe_metrics_tracker().clear()
        mean = mean_loss(chunks)
        dp = parallel_state.get_data_parallel_world_size()
        routers = router_losses(model, MICROBATCHES // dp)
        if mean is not None:
            with open(os.path.join(workdir, scheme, "loss.json"), "w") as f:
                json.dump(mean, f)
        if routers and dist.get_rank() == 0:
            with open(os.path.join(workdir, scheme, "router_losses.json"), "w") as f:
                json.dump(routers, f)
        # every rank's: a pipeline stage may hold no norm at all (a scheme whose blocks have
        # none, on the first stage)
        rank = dist.get_rank()
        with open(os.path.join(workdir, scheme, f"norm_backend.rank{rank}"), "w") as f:
            f.write(",".join(sorted({m.backend.value for chunk in chunks
                                     for m in chunk.modules() if isinstance(m, Norm)})))
        record_depth_scales(chunks, os.path.join(workdir, scheme))
        grads_into_params(chunks)
        weights.save(chunks, os.path.join(workdir, scheme, "grads"))
    parallel.destroy()


def optimizer_step(chunks, distributed: bool, clip_grad: float = 1.0):
    """One AdamW step with megatron's optimizer (sharded across DP when ``distributed``)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    # A large eps keeps Adam's update smooth in the gradient: with the default 1e-8, entries
    # whose gradient is near zero turn summation-order noise into +-lr steps.
    config = OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1, clip_grad=clip_grad,
                             adam_eps=1e-3, use_distributed_optimizer=distributed)
    optimizer = get_megatron_optimizer(config, chunks)
    optimizer.zero_grad()
    dp, dp_rank = (parallel_state.get_data_parallel_world_size(),
                   parallel_state.get_data_parallel_rank())
    mine = batches(MICROBATCHES)[dp_rank::dp]
    forward_backward(chunks, mine, len(mine), SEQ, MBS)
    ok, grad_norm, _ = optimizer.step()
    assert ok
    return grad_norm


def run_optimizer_step(scheme: str, workdir: str, distributed: bool,
                       layout: dict | None = None, model_overrides: dict | None = None,
                       clip_grad: float = 1.0) -> None:
    """Load the reference weights, take one optimizer step, save the updated weights.
    ``layout``: ParallelConfig fields besides the optimizer's; ``model_overrides``: fields of
    the tiny model."""
    par = ParallelConfig(distributed_optimizer=distributed, **(layout or {}))
    parallel.initialize(par)
    chunks = wrap_ddp(build_model(tiny_model(scheme, **(model_overrides or {})), par), par)
    weights.load(chunks, os.path.join(workdir, "weights"))
    grad_norm = optimizer_step(chunks, distributed, clip_grad)
    weights.save(chunks, os.path.join(workdir, "stepped"))
    if dist.get_rank() == 0:
        with open(os.path.join(workdir, "grad_norm.json"), "w") as f:
            json.dump(grad_norm, f)
    parallel.destroy()


def run_fresh(layout: dict, cases: dict[str, tuple[str, dict]], workdir: str,
              seed: int) -> None:
    """Build each case's model fresh from ``seed`` in ``layout`` (no weights loaded), write its
    step-1 loss, its parameter count and its initial weights (unsharded through the
    checkpoint format)."""
    par = ParallelConfig(distributed_optimizer=False, **layout)
    parallel.initialize(par, seed=seed + 1)  # the model's seed is build_model's, not torch's
    for name, (scheme, overrides) in cases.items():
        folder = os.path.join(workdir, name)
        chunks = wrap_ddp(build_model(tiny_model(scheme, **overrides), par,
                                      norm_backend="torch", seed=seed), par)
        weights.save(chunks, os.path.join(folder, "weights"))
        count = model_parameters(chunks)
        if dist.get_rank() == 0:
            with open(os.path.join(folder, "parameters.json"), "w") as f:
                json.dump(count, f)
        mean = mean_loss(chunks)
        if mean is not None:
            with open(os.path.join(folder, "loss.json"), "w") as f:
                json.dump(mean, f)
    parallel.destroy()


def run_llama_import(folder: str, model, workdir: str) -> None:
    """Load a Hugging Face Llama into ``model`` at TP=2 x PP=2 and write the mean loss of the
    parity batches."""
    from pretrain.hf import llama as hf_llama

    par = ParallelConfig(tp=2, pp=2, distributed_optimizer=False)
    parallel.initialize(par)
    chunks = wrap_ddp(build_model(model, par, norm_backend="torch"), par)
    hf_llama.load(chunks, folder, model)
    mean = mean_loss(chunks)
    if mean is not None:
        with open(os.path.join(workdir, "loss.json"), "w") as f:
            json.dump(mean, f)
    parallel.destroy()
