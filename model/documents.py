"""Attention within the documents of a packed sequence.

Pretraining packs several documents into each sequence, each ended by the tokenizer's
end-of-document token (EOD). With document attention a token attends only to the earlier
tokens of its own document; the EOD belongs to the document it ends (Megatron-LM's
``--reset-attention-mask`` draws the same boundary).

How the boundaries reach the attention: as the ``attention_mask`` argument of megatron's model,
in the form of this module, :func:`attention_mask`: the document index of every token, an
integer tensor of shape [b, 1, 1, s]. megatron hands ``attention_mask`` through the block, its
layers, recomputation (as a saved tensor) and into the core attention untouched, and every
pipeline stage reads it from its own copy of the micro-batch, so TP, SP, PP and recompute need
nothing more. Nothing of size s x s exists until a core attention asks for it: each backend
turns the ids into what its kernel takes (:func:`spans`, each document's positions, for one
causal call per document; :func:`keep_mask`, the exact boolean mask; a flex attention block
mask on CUDA, built per micro-batch from the ids in O(s^2 / 128^2)).
megatron's own masks are boolean (True = masked), so a backend tells the two forms apart by
:func:`is_document_ids`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """[..., s] int32: for each token, how many documents ended before it (an EOD counts for
    the document it ends, not the next)."""
    ends = tokens == eod
    return (torch.cumsum(ends, dim=-1, dtype=torch.int32) - ends.int()).to(torch.int32)


def attention_mask(ids: torch.Tensor) -> torch.Tensor:
    """The ``attention_mask`` a model is called with for document attention: ids [b, s] as
    [b, 1, 1, s] (megatron's masks broadcast over heads and queries the same way)."""
    return ids.reshape(ids.shape[0], 1, 1, ids.shape[-1])


def is_document_ids(mask: torch.Tensor | None) -> bool:
    """Whether an ``attention_mask`` is document ids (integers) rather than megatron's boolean
    or additive masks."""
    return mask is not None and not mask.is_floating_point() and mask.dtype is not torch.bool


def _ids(mask: torch.Tensor) -> torch.Tensor:
    return mask.reshape(mask.shape[0], mask.shape[-1])


_last: dict[str, tuple] = {}


def once_per_mask(kind: str, mask: torch.Tensor, shape: tuple, make: Callable[[], object]):
    """What ``make`` derives from one micro-batch's ids, made once for all its layers (which
    are called with the same tensor) and so held once by autograd, not once per layer. The
    last result of each kind is kept with a weak reference to the ids it came from: a new
    micro-batch's ids, a new tensor even at a freed one's address, never reuse it.

    Inside a compiled block (``kernels.compile``) each block makes its own: the cache's
    state (empty, this micro-batch's, a freed one's) would be guarded, so a block's graph
    would recompile as it changes; in the graph the mask is a few fused elementwise ops."""
    if torch.compiler.is_compiling():
        return make()
    source, made_for, value = _last.get(kind, (None, None, None))
    if source is None or source() is not mask or made_for != shape:
        value = make()
        _last[kind] = (weakref.ref(mask), shape, value)
    return value


def keep_mask(mask: torch.Tensor, sq: int, sk: int) -> torch.Tensor:
    """[b, 1, sq, sk] bool, True where a query may attend to a key: the same document and not
    later. Queries are the last ``sq`` of the ``sk`` positions (bottom-right aligned)."""
    return once_per_mask("keep", mask, (sq, sk), lambda: _keep_mask(mask, sq, sk))


def _keep_mask(mask: torch.Tensor, sq: int, sk: int) -> torch.Tensor:
    ids = _ids(mask)
    keys = ids[:, None, None, :sk]
    queries = ids[:, None, sk - sq:sk, None]
    causal = torch.ones(sq, sk, dtype=torch.bool, device=ids.device).tril(diagonal=sk - sq)
    return (queries == keys) & causal


def spans(mask: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the (start, end) positions of each document, made once per micro-batch (read
    on the host: for the CPU's one-call-per-document path)."""
    return once_per_mask("spans", mask, (), lambda: _spans(mask))


def _spans(mask: torch.Tensor) -> list[list[tuple[int, int]]]:
    ids = _ids(mask)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    out = []
    for row in starts.cpu():
        first = row.nonzero().flatten().tolist()
        out.append(list(zip(first, [*first[1:], len(row)], strict=True)))
    return out


def flex_block_mask(mask: torch.Tensor, sq: int, sk: int):
    """flex attention's block mask for document ids (CUDA): blocks of 128 x 128 positions
    wholly outside every document are skipped. Making it evaluates the rule once over the
    s x s grid (transiently, once per micro-batch); nothing of that size is kept, and the
    attention itself never forms one."""
    return once_per_mask("flex", mask, (sq, sk), lambda: _flex_block_mask(mask, sq, sk))


def _flex_block_mask(mask: torch.Tensor, sq: int, sk: int):
    from torch.nn.attention.flex_attention import create_block_mask

    ids = _ids(mask)
    offset = sk - sq

    def same_document_causal(b, h, q, k):
        return (ids[b, q + offset] == ids[b, k]) & (q + offset >= k)

    return create_block_mask(same_document_causal, ids.shape[0], None, sq, sk,
                             device=ids.device)
