"""Rank entry points for the parallel-parity tests (run through tests.helpers.spawn)."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from model import parallel
from model.builder import build_model, wrap_ddp
from model.checkpoint import load_model, save_model
from model.config import ParallelConfig
from model.schedule import forward_backward
from tests.helpers import MBS, SEQ, batches, tiny_model

MICROBATCHES = 4


def grads_into_params(chunks) -> None:
    """Replace each weight by its gradient so a checkpoint of the model stores the grads."""
    with torch.no_grad():
        for chunk in chunks:
            for param in chunk.module.parameters():
                param.copy_(param.main_grad)


def record_depth_scales(chunks, folder: str) -> None:
    """Write {global block index: c_l} for the blocks this rank holds."""
    scales = {
        layer.layer_number - 1: layer.depth_scale
        for chunk in chunks for layer in chunk.module.decoder.layers
    }
    with open(os.path.join(folder, f"depth_scales.rank{dist.get_rank()}.json"), "w") as f:
        json.dump(scales, f)


def run_layout(layout: dict, schemes: list[str], workdir: str) -> None:
    """Load the reference weights into a sharded model, run one batch, save losses and grads."""
    par = ParallelConfig(distributed_optimizer=False, **layout)
    parallel.initialize(par)
    dp = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    for scheme in schemes:
        chunks = wrap_ddp(build_model(tiny_model(scheme), par), par)
        load_model(chunks, os.path.join(workdir, scheme, "weights"))
        mine = batches(MICROBATCHES)[dp_rank::dp]
        losses = forward_backward(chunks, mine, len(mine), SEQ, MBS)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, losses)
        if dist.get_rank() == 0:
            per_rank = [losses for losses in gathered if losses]
            mean = sum(map(sum, per_rank)) / sum(map(len, per_rank))
            with open(os.path.join(workdir, scheme, "loss.json"), "w") as f:
                json.dump(mean, f)
        record_depth_scales(chunks, os.path.join(workdir, scheme))
        grads_into_params(chunks)
        save_model(chunks, os.path.join(workdir, scheme, "grads"))
    parallel.destroy()
