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

POSITION_PARTS = 8
"""Equal parts of the sequence a validation's loss is also reported by (:func:`lm_loss`)."""


def lm_loss(loss_mask: torch.Tensor, per_token_loss: torch.Tensor, parts: int = 0):
    """The micro-batch's mean cross entropy over its unmasked tokens. Under context
    parallelism each rank holds a share of every sequence: it returns its own tokens' sum over
    the whole sequence's count (megatron's schedule multiplies that by the context-parallel
    size, and DDP averages gradients over data x context ranks, so the gradient is the whole
    sequence's mean), and reports the whole sequence's mean. With ``parts`` it also reports
    the loss by position: [parts, 2] float64 sums and counts over each of ``parts`` equal
    spans of the sequence (the long-context check: a model that uses its context has lower
    loss later in it)."""
    mask = loss_mask.reshape(-1).float()
    total = (per_token_loss.float().reshape(-1) * mask).sum()
    if context.size() == 1:
        loss = total / mask.sum()
        # The schedule scales the returned loss in place; report an independent copy.
        report = {"lm loss": loss.detach().clone()}
    else:
        whole_total, whole_count = context.sequence_sums(torch.stack([total, mask.sum()]))
        loss, report = total / whole_count, {"lm loss": whole_total / whole_count}
    if parts:
        report["loss by position"] = _by_position(loss_mask, per_token_loss, parts)
    return loss, report


def _by_position(loss_mask: torch.Tensor, per_token_loss: torch.Tensor,
                 parts: int) -> torch.Tensor:
    local = per_token_loss.shape[-1]
    index = context.sequence_index(local, per_token_loss.device)
    part = (index * parts // (local * context.size())).expand_as(per_token_loss).reshape(-1)
    mask = loss_mask.reshape(-1).double()
    sums = torch.zeros(parts, 2, dtype=torch.float64, device=per_token_loss.device)
    sums[:, 0].index_add_(0, part, per_token_loss.detach().reshape(-1).double() * mask)
    sums[:, 1].index_add_(0, part, mask)
    return context.sequence_sums(sums)


def forward_step(data_iterator: Iterator[dict], model, parts: int = 0):
    """A micro-batch's forward on this rank's share of it (:func:`runtime.context.split_batch`);
    its ``attention_mask``, when present, is document ids (model.documents), read by every
    pipeline stage from its own copy of the micro-batch. ``parts``: :func:`lm_loss`'s."""
    batch = context.split_batch(next(data_iterator))
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
                   labels=batch["labels"])
    return output, partial(lm_loss, batch["loss_mask"], parts=parts)


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


def validation_losses(chunks: list, microbatches: Iterable[dict], num_microbatches: int,
                      seq_length: int, micro_batch_size: int,
                      parts: int = POSITION_PARTS) -> list[dict]:
    """A forward-only pass: each micro-batch's ``lm loss`` and ``loss by position``
    (:func:`lm_loss`) on the last pipeline stage (empty elsewhere)."""
    return run_schedule(chunks, microbatches, num_microbatches, seq_length, micro_batch_size,
                        partial(forward_step, parts=parts), forward_only=True)


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
