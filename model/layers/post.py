"""Post-Norm (baseline): h <- N_k(h + F_k(h)) for k in (attn, mlp); no final norm."""

from __future__ import annotations

import torch

from model.config import ModelConfig
from model.layers.base import BranchInputs, LayerChoice, SchemeLayer


class PostNormLayer(SchemeLayer):
    def __init__(self, config, submodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.attn_post_norm = self.build_norm()
        self.mlp_post_norm = self.build_norm()

    def compute(self, h: torch.Tensor, inputs: BranchInputs) -> torch.Tensor:
        h = self.attn_post_norm(h + self.attention(h, inputs))
        return self.mlp_post_norm(h + self.feed_forward(h, inputs))


def layer(model: ModelConfig, index: int) -> LayerChoice:
    return PostNormLayer, {}
