"""HybridNorm (baseline): QKV-norm attention and Post-Norm around the MLP, one stream.

For every block (the x-stream recipe of SiameseNorm's hybrid_pre, without y):

    attention:  h = h + Attn(h)          # no input norm; per-head norms on Q, K and V
    MLP:        u = Npost_mlp(h)         # h is replaced by its normalised value
                h = u + MLP(u)

The last block's output is not normalised, so a final norm closes the decoder.

HybridNorm* (``model.hybrid_first_block = "prenorm"``, as the official code's flag
``{0: {'attn_norm': True, 'ffn_residual': False}}``) makes block 0 a Pre-Norm block that keeps
the QKV-norm attention: h = h + Attn(N_attn(h)); h = h + MLP(N_mlp(h)): megatron's own
Pre-Norm layer (``layer`` returns None for it).
"""

from __future__ import annotations

import torch

from kernels.norms import residual_norm
from model.config import ModelConfig
from model.layers.base import BranchInputs, LayerChoice, SchemeLayer
from model.schemes import FirstBlock


class HybridNormLayer(SchemeLayer):
    def __init__(self, config, submodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.mlp_post_norm = self.build_norm()

    def compute(self, h: torch.Tensor, inputs: BranchInputs) -> torch.Tensor:
        u = residual_norm(self.mlp_post_norm, h, self.attention(h, inputs))  # N(h + Attn(h))
        return u + self.feed_forward(u, inputs)


def layer(model: ModelConfig, index: int) -> LayerChoice:
    if index == 0 and model.hybrid_first_block is FirstBlock.PRENORM:
        return None
    return HybridNormLayer, {}
