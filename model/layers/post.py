"""Post-Norm (baseline): h <- N_k(h + F_k(h)) for k in (attn, mlp); no final norm.

Each residual add and its norm are one op (``kernels.norms.residual_norm``): with the triton
backend one pass that never stores the sum. ``alpha`` scales the skip (1 here; DeepNorm's).
"""

from __future__ import annotations

import torch

from kernels.norms import residual_norm
from model.config import ModelConfig
from model.layers.base import BranchInputs, LayerChoice, SchemeLayer


class PostNormLayer(SchemeLayer):
    alpha = 1.0

    def __init__(self, config, submodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.attn_post_norm = self.build_norm(site="attention")
        self.mlp_post_norm = self.build_norm()

    def compute(self, h: torch.Tensor, inputs: BranchInputs) -> torch.Tensor:
        h = residual_norm(self.attn_post_norm, h, self.attention(h, inputs), self.alpha)
        return residual_norm(self.mlp_post_norm, h, self.feed_forward(h, inputs), self.alpha)


def layer(model: ModelConfig, index: int) -> LayerChoice:
    return PostNormLayer, {}
