"""What the compiled-block tests measure, in the test process or on spawned gloo ranks: one
model's graphs, breaks and recompiles per step, and its logits and gradients eager against
compiled (tests/model/test_compiled_blocks.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from model import compiled
from model.builder import build_model, wrap_ddp
from model.config import ParallelConfig
from runtime import parallel
from runtime.schedule import forward_backward
from tests.helpers import MBS, SEQ, document_batches, tiny_model


def step_counts(scheme: str, parallel_fields: dict, backend: str = "eager",
                steps: int = 3, layers: int = 3, norm_backend: str = "torch",
                microbatches: int = 2, model_fields: dict | None = None,
                ) -> list[tuple[int, int]]:
    """(graphs compiled, graph breaks) in each of ``steps`` steps of ``microbatches``
    micro-batches whose packed documents differ from batch to batch (``model_fields``: the
    tiny model's own)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    par = ParallelConfig(distributed_optimizer=False, **parallel_fields)
    chunks = build_model(tiny_model(scheme, num_layers=layers, **(model_fields or {})), par,
                         norm_backend=norm_backend, positions_per_token=True)
    compiled.compile_blocks(chunks, backend)
    ddp = wrap_ddp(chunks, par)
    counts = []
    for step in range(steps):
        probe = compiled.Counts().start()
        forward_backward(ddp, iter(document_batches(microbatches, seed=step)), microbatches,
                         SEQ, MBS)
        counts.append((probe.graphs(), probe.breaks()))
    return counts


def loss_and_grads(scheme: str, parallel_fields: dict, backend: str | None, layers: int = 3,
                   norm_backend: str = "torch", seq: int = SEQ,
                   model_fields: dict | None = None,
                   ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and every gradient of one step of packed documents of ``seq`` tokens, eager
    (``backend`` None) or compiled."""
    torch._dynamo.reset()
    par = ParallelConfig(distributed_optimizer=False, **parallel_fields)
    torch.manual_seed(3)
    model = tiny_model(scheme, num_layers=layers, seq_length=seq, **(model_fields or {}))
    chunks = build_model(model, par, seed=11, norm_backend=norm_backend,
                         positions_per_token=True)
    if backend is not None:
        compiled.compile_blocks(chunks, backend)
    ddp = wrap_ddp(chunks, par)
    losses = forward_backward(ddp, iter(document_batches(2, seed=5, seq=seq)), 2, seq, MBS)
    grads = {n: p.main_grad.clone() for c in ddp for n, p in c.module.named_parameters()}
    return [float(x) for x in losses], grads


def worst_relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest |a - b| / max|b| over the tensors of ``b`` (a norm-relative error, so a
    gradient entry near zero does not blow it up)."""
    return max(float((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-30)) for n in b)


def rank_counts(schemes: list[str], parallel_fields: dict, out: str, layers: int = 4) -> None:
    """On each spawned rank: :func:`step_counts` for ``schemes`` (``layers`` blocks), written
    by rank 0."""
    parallel.initialize(ParallelConfig(**parallel_fields), seed=1234)
    result = {}
    for scheme in schemes:
        # 4 layers (the default): divisible by pp x vp; interleaving needs more micro-batches
        # than stages (as pretrain.config requires; with as many, two-stream schemes' shape
        # exchange deadlocks in megatron's schedule)
        counts = step_counts(scheme, parallel_fields, layers=layers,
                             microbatches=4 if parallel_fields.get("vp") else 2)
        result[scheme] = {"counts": counts, "reasons": {
            reason.splitlines()[0]: n for reason, n in compiled.break_reasons().items()}}
    if torch.distributed.get_rank() == 0:
        Path(out).write_text(json.dumps(result))
    parallel.destroy()


def rank_parity(schemes: list[str], layouts: dict[str, dict], out: str) -> None:
    """On each spawned rank: for each scheme and named layout (all of one TP size), the worst
    relative loss and gradient differences of compiled (aot_eager) against eager, written by
    rank 0 (each rank's gradients are its shards: rank 0's stand for both)."""
    tp = {fields.get("tp", 1) for fields in layouts.values()}
    assert len(tp) == 1, layouts
    parallel.initialize(ParallelConfig(tp=tp.pop()), seed=1234)
    result = {}
    for scheme in schemes:
        for name, fields in layouts.items():
            losses, grads = loss_and_grads(scheme, fields, None)
            c_losses, c_grads = loss_and_grads(scheme, fields, "aot_eager")
            result[f"{scheme} {name}"] = {
                "loss": max(abs(c - e) / abs(e) for c, e in zip(c_losses, losses, strict=True)),
                "grads": worst_relative(c_grads, grads)}
    if torch.distributed.get_rank() == 0:
        Path(out).write_text(json.dumps(result))
    parallel.destroy()
