"""Mix-LN (baseline): Post-Norm in the first blocks, Pre-Norm in the rest, one stream.

With L = num_layers and ratio = ``mixln_post_ratio`` (Mix-LN's alpha, 0.25 in the paper), the
first P = floor(ratio * L) global blocks l < P are Post-Norm blocks and the rest Pre-Norm:

    l < P:   h = N_k(h + F_k(h))          (:class:`model.layers.post.PostNormLayer`)
    l >= P:  h = h + F_k(N_k(h))          (megatron's own Pre-Norm TransformerLayer)

and a final norm closes the block: out = N_final(h). The spec picks each block's class from its
global index, so every pipeline layout splits the model at the same block.
"""

from __future__ import annotations

import math


def post_norm_blocks(num_layers: int, ratio: float) -> int:
    """P = floor(ratio * L); the rounding guards against 0.29 * 100 = 28.999...96."""
    return math.floor(round(ratio * num_layers, 9))


def is_post_norm_block(index: int, num_layers: int, ratio: float) -> bool:
    """Whether global block ``index`` (0-based) is a Post-Norm block."""
    return index < post_norm_blocks(num_layers, ratio)
