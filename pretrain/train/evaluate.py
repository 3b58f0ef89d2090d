"""Validation: the loss over a whole validation set (in the loop, every ``run.eval_interval``
steps), and the ``eval`` command, which scores a checkpoint on the config's datasets."""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from pretrain.build import preflight, setup
from pretrain.config import Config
from pretrain.data.batches import build_datasets, microbatches_per_step, step_microbatches
from pretrain.report.metrics import strict_json
from pretrain.run.checkpoint import run_folder, weights_source
from runtime import device, weights
from runtime.schedule import forward_backward

log = logging.getLogger("pretrain")


def evaluate_checkpoint(config: Config, path: str) -> dict:
    """The checkpoint's model and tokenizer must be the config's (checked before loading); the
    data may be any, so a checkpoint can be scored on other validation data. The result is
    appended to ``eval.jsonl`` of the checkpoint's run folder, next to what it describes."""
    tokenizer = preflight(config)
    found = weights_source(path, config)
    chunks = setup(config)
    weights.load(chunks, found)
    _, valid = build_datasets(config, tokenizer)
    result = {"checkpoint": str(found), **evaluate(config, chunks, valid)}
    if dist.get_rank() == 0:
        log_to = run_folder(found) / "eval.jsonl"
        try:
            with log_to.open("a") as f:
                f.write(strict_json(result) + "\n")
        except OSError as err:  # a read-only checkpoint is still scored; the result is printed
            log.warning("could not append the result to %s: %s", log_to, err.strerror)
    return result


def loss_share(losses: list[torch.Tensor]) -> torch.Tensor:
    """This rank's [mean micro-batch loss, weight] towards the batch loss (float64, on the
    compute device): only the logging ranks of the last pipeline stage (first TP rank) hold a
    loss; the others add [0, 0]."""
    share = torch.zeros(2, dtype=torch.float64, device=device.compute_device())
    if losses and parallel_state.get_tensor_model_parallel_rank() == 0:
        share[0], share[1] = torch.stack(losses).double().mean(), 1.0
    return share


def _mean_loss(per_batch: list[list[torch.Tensor]]) -> float:
    """The mean over batches of the batch loss (mean over data-parallel replicas), read back
    once."""
    totals = torch.stack([loss_share(losses) for losses in per_batch])
    dist.all_reduce(totals)
    return float((totals[:, 0] / totals[:, 1]).mean())


def evaluate(config: Config, chunks, dataset) -> dict:
    """Mean validation loss over the whole validation set (data.valid_samples sequences from
    its start, in full global batches, so the mean of batch means is the mean over
    sequences), its perplexity, and the set's size (logged with them, so a number is never
    read without the set it was measured on)."""
    d = config.data
    for chunk in chunks:
        chunk.eval()
    per_batch = []
    with torch.no_grad():
        for i in range(d.valid_samples // d.global_batch_size):
            batch = step_microbatches(dataset, i * d.global_batch_size, d.global_batch_size,
                                      d.micro_batch_size)
            n = microbatches_per_step(d.global_batch_size, d.micro_batch_size)
            per_batch.append(forward_backward(
                chunks, batch, n, config.seq_length, d.micro_batch_size, forward_only=True))
    for chunk in chunks:
        chunk.train()
    loss = _mean_loss(per_batch)
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 80.0)),
            "val_samples": d.valid_samples}
