"""Mix-LN (baseline): Post-Norm in the first blocks, Pre-Norm in the rest, one stream.

With L = num_layers and ratio = ``mixln_post_ratio`` (Mix-LN's alpha, 0.25 in the paper), the
first P = floor(ratio * L) global blocks l < P are Post-Norm blocks and the rest Pre-Norm:

    l < P:   h = N_k(h + F_k(h))          (:class:`model.layers.post.PostNormLayer`)
    l >= P:  h = h + F_k(N_k(h))          (megatron's own Pre-Norm TransformerLayer)

and a final norm closes the decoder: out = N_final(h). Each block's class follows from its
global index, so every pipeline layout splits the model at the same block.
"""

from __future__ import annotations

import math

from model.config import ModelConfig
from model.layers.base import LayerChoice
from model.layers.post import PostNormLayer


def post_norm_blocks(num_layers: int, ratio: float) -> int:
    """P = floor(ratio * L); the rounding guards against 0.29 * 100 = 28.999...96."""
    return math.floor(round(ratio * num_layers, 9))


def layer(model: ModelConfig, index: int) -> LayerChoice:
    if index < post_norm_blocks(model.num_layers, model.mixln_post_ratio):
        return PostNormLayer, {}
    return None
