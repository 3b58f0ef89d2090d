"""One forward-backward pass over a batch of microbatches with megatron-core's schedules.

megatron picks the schedule from the parallel state: no pipelining, 1F1B, or interleaved 1F1B
with virtual stages. The loss is the mean next-token cross entropy over unmasked tokens of
each microbatch; the schedule averages microbatches (and DP averages replicas), which equals
the token mean of the whole batch because every microbatch has the same number of tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from functools import partial

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from runtime import context


def lm_loss(loss_mask: torch.Tensor, per_token_loss: torch.Tensor):
    """The micro-batch's mean cross entropy over its unmasked tokens. Under context
    parallelism each rank holds a share of every sequence: it returns its own tokens' sum over
    the whole sequence's count (megatron's schedule multiplies that by the context-parallel
    size, and DDP averages gradients over data x context ranks, so the gradient is the whole
    sequence's mean), and reports the whole sequence's mean."""
    mask = loss_mask.reshape(-1).float()
    total = (per_token_loss.float().reshape(-1) * mask).sum()
    if context.size() == 1:
        loss = total / mask.sum()
        # The schedule scales the returned loss in place; report an independent copy.
        return loss, {"lm loss": loss.detach().clone()}
    whole_total, whole_count = context.sequence_sums(torch.stack([total, mask.sum()]))
    return total / whole_count, {"lm loss": whole_total / whole_count}


def forward_step(data_iterator: Iterator[dict], model):
    """A micro-batch's forward on this rank's share of it (:func:`runtime.context.split_batch`);
    its ``attention_mask``, when present, is document ids (model.documents), read by every
    pipeline stage from its own copy of the micro-batch."""
    batch = context.split_batch(next(data_iterator))
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
                   labels=batch["labels"])
    return output, partial(lm_loss, batch["loss_mask"])


def forward_backward(
    chunks: list, microbatches: Iterable[dict], num_microbatches: int, seq_length: int,
    micro_batch_size: int, forward_only: bool = False,
) -> list[torch.Tensor]:
    """Run the schedule over DDP-wrapped chunks (:func:`model.builder.wrap_ddp`); returns the
    per-microbatch losses on the last pipeline stage (empty elsewhere) as 0-dim tensors on the
    compute device, so that a training step reads them back to the host once, not once per
    micro-batch. Gradients are left in the chunks' ``main_grad`` buffers, finalised across
    ranks."""
    for chunk in chunks:
        chunk.zero_grad_buffer()
    results = run_schedule(chunks, microbatches, num_microbatches, seq_length, micro_batch_size,
                           forward_step, forward_only)
    return [r["lm loss"] for r in results]


def run_schedule(chunks: list, microbatches: Iterable[dict], num_microbatches: int,
                 seq_length: int, micro_batch_size: int, step_func,
                 forward_only: bool = True) -> list[dict]:
    """megatron's schedule over ``microbatches`` with ``step_func`` (megatron's forward-step
    contract: (data iterator, model) -> (output, loss function returning (loss, dict))).
    Returns the loss functions' dicts on the last pipeline stage, one per micro-batch (empty
    elsewhere): how a forward-only pass gets any per-sequence result out of the pipeline."""
    batches = list(microbatches)
    iterators = [iter(batches) for _ in chunks] if len(chunks) > 1 else iter(batches)
    results = get_forward_backward_func()(
        forward_step_func=step_func,
        data_iterator=iterators,
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return []
    return list(results)
