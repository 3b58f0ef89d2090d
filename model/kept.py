"""What a block keeps for backward outside its attention and MLP, declared per residual scheme
(``Traits.kept``): the dry run's activation estimate (``pretrain.report.dry_run``) adds it up,
and ``tests/bench/test_saved_activations.py`` holds it byte for byte per token to the tensors
autograd keeps, for every scheme and every normalization.

A scheme says which norms its block applies and what else it keeps; what one norm keeps is
its kind's (``kernels.normalizations.Kept``: the fused kernels keep the input and two fp32
statistics per row, a DyT an fp32 copy of its input and its fp32 tanh). Like
:mod:`model.schemes`, which reads it, a leaf: the ModelConfig is only called on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ModelConfig = Any


@dataclass(frozen=True)
class Outside:
    """Per token, what one block keeps outside its branches.

    ``norms``: rows of h values its norms normalise whose input nothing else keeps (a norm
    that keeps its input is the one keeping it); ``shared_norms``: rows whose input another
    operation keeps anyway (counted in ``values``); ``values``: the other h-sized values it
    keeps (a branch output a learned weight multiplies, the streams a mixing reads, the layer
    input a fused entry keeps); ``bytes``: its own per-token tensors (gates, mixing weights)."""

    norms: int
    shared_norms: int = 0
    values: int = 0
    bytes: int = 0


Kept = Callable[[ModelConfig, int, bool], Outside]
"""``kept(model, width, fused)``: a block's :class:`Outside` in an activation dtype of
``width`` bytes; ``fused``: the kernels compute the model's normalization, so the two-stream
layers run their fused entries (else the composition of their norms)."""


def norms_only(count: int) -> Kept:
    """A block that keeps only the inputs of ``count`` norms of one row each: the one-stream
    schemes whose residual adds keep nothing (pre: 2, hybridnorm: 1, its attention has no norm
    in front; periln: 4, the branch outputs' norms too)."""
    def kept(_model: ModelConfig, _width: int, _fused: bool) -> Outside:
        return Outside(norms=count)
    return kept


def two_stream(gate: bool) -> Kept:
    """SiameseNorm's two entries of three norms each (``gate``: the hybrid form's attention
    entry is x g + Npre(y), a channel gate and one norm).

    Fused, the kernels keep their inputs, not their outputs: the layer input (2h), read by
    the attention entry, and the attention output r (h): the MLP entry re-derives the updated
    streams from them, recomputing u = Npost(x); with the gate x reaches attention through it,
    and the gate keeps x itself, a half of the layer input. Statistics: six rows either way.
    Unfused, each norm keeps what its kind keeps of its own input (every one computed here,
    nothing else keeps it), and the gate keeps the layer input, whose y half the gated entry's
    norm reads."""
    def kept(_model: ModelConfig, _width: int, fused: bool) -> Outside:
        if fused:
            return Outside(norms=0, shared_norms=6, values=3)
        if gate:
            return Outside(norms=3, shared_norms=1, values=2)
        return Outside(norms=6)
    return kept


def hyper_connections(model: ModelConfig, width: int, _fused: bool) -> Outside:
    """Per sublayer its norm and what its connection keeps: the n streams it mixes (n h) and
    the branch output it scales into every stream (h); dynamic, also the n rows of the streams'
    norm (their input is those streams), its normalised output that the projection reads
    (n h), the tanh of that projection (n (n + 2) values) and the three weights made from it
    (width n, depth n^2, output n), each kept by the product that applies it."""
    n = model.hc_rate
    if not model.hc_dynamic:
        return Outside(norms=2, values=2 * (n + 1))
    return Outside(norms=2, shared_norms=2 * n, values=2 * (2 * n + 1),
                   bytes=2 * (2 * n * n + 4 * n) * width)


def manifold_hyper_connections(model: ModelConfig, width: int, _fused: bool) -> Outside:
    """Per sublayer its norm, the n streams (read by the mapping's product, the aggregation and
    H_res) and the branch output H_post scales (n h + h), and the mappings' per-token values:
    the fp32 norm of the flattened streams and its reciprocal RMS (2 values), three fp32
    copies of the n^2 + 2n mapping logits (the product's fp32 cast, its normalised form the
    gates multiply, the logits Sinkhorn keeps), H_pre's and H_post's fp32 sigmoids (2n), and
    the three mappings in the activation dtype the mixing multiplies by (n^2 + 2n; in an fp32
    model H_pre's is its sigmoid's output itself). The flattened streams' RMS is applied after
    the product, so no normalised copy is kept. A sublayer's fp32 gate vector, n^2 + 2n
    values, is kept once whatever the tokens: not per token."""
    n = model.hc_rate
    fp32 = 2 + 3 * (n * n + 2 * n) + 2 * n
    mappings = n * n + (2 * n if width < 4 else n)
    return Outside(norms=2, values=2 * (n + 1), bytes=2 * (4 * fp32 + mappings * width))
