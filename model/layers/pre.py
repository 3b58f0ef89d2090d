"""Pre-Norm (baseline): h <- h + F_k(N_k(h)); a final norm closes the decoder.

Every block is megatron's own TransformerLayer (``layer`` returns None), so single-stream
Pre-Norm pays nothing for the framework and uses TE's fused norm+linear where TE is installed.
"""

from __future__ import annotations

from model.config import ModelConfig
from model.layers.base import LayerChoice


def layer(model: ModelConfig, index: int) -> LayerChoice:
    return None
