"""Rank entry point of the Muon parity test (run through tests.helpers.spawn)."""

from __future__ import annotations

import json
import os

import torch
from megatron.core import parallel_state

from model import decay
from model.builder import build_model, wrap_ddp
from model.config import ParallelConfig
from pretrain.config import Config, DecayStyle, OptimConfig, OptimName, RunConfig
from pretrain.optim import build_optimizer
from runtime import parallel, weights
from runtime.schedule import forward_backward
from tests.helpers import MBS, SEQ, batches, tiny_model

STEPS, MICROBATCHES = 3, 4


def parity_config(scheme: str, layout: dict, model: dict | None = None) -> Config:
    """Muon at a small LR: its Newton-Schulz runs in bf16, so a gradient that differs in the
    last fp32 bit (another summation order across ranks) can round an orthogonalised entry the
    other way, a step 2^-8 of its size apart (1.3e-5 after 3 steps at 1e-3, 2026-12-06);
    AdamW with a large eps (summation-order noise in a near-zero gradient would become a +-lr
    step); a warm-up, a cosine decay and clipping across both. At muon_lr 1e-4 TP=2 came
    within 2.5e-6 of one process and a shard orthogonalised alone missed by 5e-5."""
    return Config(
        model=tiny_model(scheme, **(model or {})),
        parallel=ParallelConfig(**{"distributed_optimizer": False, **layout}),
        run=RunConfig(steps=STEPS),
        optim=OptimConfig(name=OptimName.MUON, lr=1e-3, min_lr=1e-4, muon_lr=1e-4,
                          warmup_steps=1, decay_style=DecayStyle.COSINE, eps=1e-3,
                          clip_grad=0.5))


def run_muon_steps(scheme: str, workdir: str, layout: dict, model: dict | None = None) -> None:
    """Load the reference weights, take STEPS Muon steps on this rank's share of the batches,
    save the weights (``model``: fields of the tiny model)."""
    config = parity_config(scheme, layout, model)
    parallel.initialize(config.parallel)
    chunks = wrap_ddp(build_model(config.model, config.parallel), config.parallel,
                      decay.muon_matrix)
    weights.load(chunks, os.path.join(workdir, "weights"))
    optimizer, scheduler = build_optimizer(config, chunks, torch.float32)
    dp, rank = (parallel_state.get_data_parallel_world_size(),
                parallel_state.get_data_parallel_rank())
    for index in range(STEPS):
        optimizer.zero_grad()
        mine = batches(MICROBATCHES, seed=index)[rank::dp]
        forward_backward(chunks, mine, len(mine), SEQ, MBS)
        ok, _, _ = optimizer.step()
        assert ok
        scheduler.step(1)
    weights.save(chunks, os.path.join(workdir, "stepped"))
    _record_momenta(optimizer, chunks, workdir)
    parallel.destroy()


def _record_momenta(optimizer, chunks, workdir: str) -> None:
    """The names of the matrices whose Muon momentum this rank keeps, in ``momenta-<rank>.json``:
    under the distributed optimizer each data-parallel rank keeps those it owns only."""
    names = {param: name for chunk in chunks for name, param in chunk.named_parameters()}
    held = []
    for inner in optimizer.chained_optimizers:
        for muon in getattr(inner, "chained_optimizers", [inner]):
            if isinstance(muon.optimizer, torch.optim.Muon):
                held += [names[param] for param in muon.optimizer.state]
    with open(os.path.join(workdir, f"momenta-{torch.distributed.get_rank()}.json"), "w") as f:
        json.dump(sorted(held), f)
