"""How several residual streams cross megatron-core: as one packed tensor.

megatron's TransformerBlock, activation recomputation and the pipeline p2p exchange all move a
single ``hidden_states`` tensor between layers. Concatenating the streams on the hidden
dimension (SiameseNorm's x and y: [s, b, 2h]; hyper-connections' n streams: [s, b, n h]) lets
all of them work unchanged; this module is the only place that knows the layout, save one:
the fused kernels' registered operators (``kernels/stream_library.py``, compiled blocks only)
take no callable, so they split [x | y] themselves, as :func:`unpack` does.
"""

from __future__ import annotations

import torch


def pack(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Join the Post-Norm-like stream x and the Pre-Norm-like stream y into [s, b, 2h]."""
    return torch.cat((x, y), dim=-1)


def unpack(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a packed [s, b, 2h] tensor into (x, y): views, so writing them fills ``packed``."""
    x, y = packed.chunk(2, dim=-1)
    return x, y


def empty(like: torch.Tensor) -> torch.Tensor:
    """An uninitialised packed tensor for streams shaped like ``like`` (a kernel fills it
    through :func:`unpack`)."""
    return like.new_empty((*like.shape[:-1], 2 * like.shape[-1]))


def start(embedding: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both streams begin as the embedding output. Every later update is out of place, so y
    starting as the same tensor never aliases a value that is later modified."""
    return embedding, embedding


def split(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The n streams of a packed [s, b, n h] tensor as a [s, b, n, h] view."""
    # reshape, not Tensor.unflatten: the same view, but unflatten's Python wrapper calls
    # super(), which torch.compile cannot trace (a graph break in every compiled block).
    return packed.reshape(*packed.shape[:-1], n, packed.shape[-1] // n)


def join(streams: torch.Tensor) -> torch.Tensor:
    """The packed [s, b, n h] tensor of streams [s, b, n, h] (the inverse of :func:`split`)."""
    return streams.flatten(-2)


def repeat(embedding: torch.Tensor, n: int) -> torch.Tensor:
    """n streams [s, b, n, h] that all begin as the embedding [s, b, h]."""
    return embedding.unsqueeze(-2).expand(*embedding.shape[:-1], n, embedding.shape[-1])
