"""The attention's side of context parallelism: every rank's queries against the keys and values
of the whole sequence (Llama 3's all-gather context parallelism).

Each rank holds two chunks of every sequence (``runtime.context``: chunks r and 2 cp - 1 - r
of 2 x cp). Its K and V, already rotated by their own positions, are all-gathered over the
context-parallel group and put back in sequence order; in backward their gradients are
reduce-scattered to the ranks that hold them (megatron's sequence-parallel gather, given the
context-parallel group). The queries of each held chunk then attend to the keys up to that
chunk's end, the chunk being the last of them: causality (and, with document attention, the
same-document rule of the gathered ids) is bottom-right aligned, as in decoding, so the core
attention's own paths compute it. The gather moves 2 x kv x s values per layer and rank
(``kv`` the K/V width of the rank's heads), against ring attention's overlapped exchange: the
cost of keeping every backend's attention kernel as it is, and exact document masking.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from model import documents
from runtime import context


def _sequence_order(cp: int) -> list[int]:
    """For each chunk of the sequence in order, where it lies in the gathered tensor (rank 0's
    two chunks first, then rank 1's, ...)."""
    where = {}
    for cp_rank in range(cp):
        for slot, chunk in enumerate(context.chunks(cp_rank, cp)):
            where[chunk] = 2 * cp_rank + slot
    return [where[chunk] for chunk in range(2 * cp)]


def _in_order(gathered: torch.Tensor, cp: int, dim: int) -> torch.Tensor:
    """The gathered chunks along ``dim`` put in sequence order."""
    pieces = gathered.chunk(2 * cp, dim=dim)
    return torch.cat([pieces[i] for i in _sequence_order(cp)], dim=dim)


def gather_sequence(t: torch.Tensor) -> torch.Tensor:
    """[s/cp, ...] -> [s, ...] in sequence order, over the context-parallel group; backward
    reduce-scatters the gradient back."""
    gathered = gather_from_sequence_parallel_region(t, tensor_parallel_output_grad=True,
                                                    group=context.group())
    return _in_order(gathered, context.size(), 0)


def gather_ids(mask: torch.Tensor) -> torch.Tensor:
    """Document ids [b, 1, 1, s/cp] -> [b, 1, 1, s] in sequence order (no gradient), once per
    micro-batch (every layer is called with the same tensor)."""
    def gather() -> torch.Tensor:
        pieces = [torch.empty_like(mask) for _ in range(context.size())]
        dist.all_gather(pieces, mask.contiguous(), group=context.group())
        return _in_order(torch.cat(pieces, dim=-1), context.size(), -1)
    return documents.once_per_mask("context", mask, (), gather)


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None],
                  torch.Tensor]


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              mask: torch.Tensor | None, attend: Attend) -> torch.Tensor:
    """Core attention of this rank's queries [s/cp, b, heads, d] against the whole sequence's
    keys and values, whose local shares are ``key`` and ``value``; ``mask``: document ids of
    the rank's tokens or None (causal). ``attend(q, k, v, ids)`` is the core attention of
    queries that are the last of the keys (bottom-right causal), ``ids`` the document ids of
    the keys or None; it returns [sq, b, heads x d]."""
    cp, cp_rank = context.size(), context.rank()
    key, value = gather_sequence(key), gather_sequence(value)
    ids = gather_ids(mask) if documents.is_document_ids(mask) else None
    chunk = query.size(0) // 2
    out = []
    for slot, index in enumerate(context.chunks(cp_rank, cp)):
        end = (index + 1) * chunk
        out.append(attend(query[slot * chunk:(slot + 1) * chunk], key[:end], value[:end],
                          None if ids is None else ids[..., :end]))
    return torch.cat(out, dim=0)
