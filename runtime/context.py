"""Context parallelism (``parallel.cp``): the sequence of every micro-batch split over the ranks
of megatron's context-parallel group, each rank running every layer on its share.

The split is megatron's (``get_batch_on_this_cp_rank``): the sequence is cut into 2 x cp equal
chunks and rank r takes chunks r and 2 cp - 1 - r, so that under causal attention every rank
has the same work (an early chunk sees few keys, its partner many). Everything outside the
attention is per token and runs on the rank's share as it is; RoPE takes each token's own
position (megatron's ``get_pos_emb_on_this_cp_rank``); the attention gathers the keys and
values of the whole sequence (``model.context_parallel``). This module is the batch's side:
:func:`split_batch` gives each rank its share of a micro-batch, and the loss of a micro-batch
(``runtime.schedule.lm_loss``) is the mean over the unmasked tokens of the whole sequence,
its sum and count added over the group (:func:`sequence_sums`). Gradients need nothing more:
megatron's DDP reduces them over data x context parallel ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.utils import get_batch_on_this_cp_rank

_IDS = "document_ids"  # the document-id mask travels as [b, s] through megatron's split


def size() -> int:
    """The context-parallel size (1 before the groups exist)."""
    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_context_parallel_world_size()


def group():
    return parallel_state.get_context_parallel_group()


def rank() -> int:
    return parallel_state.get_context_parallel_rank()


def chunks(cp_rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of 2 x cp) of the sequence that rank ``cp_rank`` holds, in the order it
    holds them."""
    return cp_rank, 2 * cp - 1 - cp_rank


def sequence_index(local_length: int, device) -> torch.Tensor:
    """The positions in the whole sequence of this rank's ``local_length`` tokens (its two
    chunks, in the order it holds them): 0 .. s - 1 without context parallelism."""
    cp = size()
    if cp == 1:
        return torch.arange(local_length, device=device)
    chunk = local_length // 2
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device)
                      for c in chunks(rank(), cp)])


def split_batch(batch: dict) -> dict:
    """This rank's share of a micro-batch ([b, s] tensors; an ``attention_mask`` of document
    ids, [b, 1, 1, s], along its last dimension): the whole batch without context
    parallelism."""
    if size() == 1:
        return batch
    parts = dict(batch)
    ids = parts.pop("attention_mask", None)
    if ids is not None:
        parts[_IDS] = ids.reshape(ids.shape[0], ids.shape[-1])
    parts = get_batch_on_this_cp_rank(parts, is_hybrid_cp=False, cp_group=group())
    if ids is not None:
        local = parts.pop(_IDS)
        parts["attention_mask"] = local.reshape(local.shape[0], 1, 1, local.shape[-1])
    return parts


def sequence_sums(values: torch.Tensor) -> torch.Tensor:
    """``values`` (sums over this rank's tokens) added over the context-parallel group,
    outside autograd: the whole sequences' sums."""
    total = values.detach().clone()
    if size() > 1:
        dist.all_reduce(total, group=group())
    return total
