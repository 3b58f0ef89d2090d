"""OLMo 2's reordered norm (Team OLMo 2024, "2 OLMo 2 Furious"): each sublayer reads the
un-normalised stream and its output is normalised before the residual add, with QK-norm.

For each sublayer k in (attn, mlp) of every block:

    h = h + N_k(F_k(h))

and the attention normalises Q and K (per head, before RoPE; ``Traits.qk_norm``), V is left
as projected. The stream is never normalised, so a final norm closes the decoder. OLMo 2 draws
every weight from one normal(0, 0.02) with no depth scaling: this scheme's output projections
start at the plain ``init_method_std`` (``Traits.depth_scaled_output_init``).
"""

from __future__ import annotations

import torch

from model.config import ModelConfig
from model.layers.base import BranchInputs, LayerChoice, SchemeLayer


class OLMo2Layer(SchemeLayer):
    def __init__(self, config, submodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.attn_out_norm = self.build_norm(site="attention")
        self.mlp_out_norm = self.build_norm()

    def compute(self, h: torch.Tensor, inputs: BranchInputs) -> torch.Tensor:
        h = h + self.attn_out_norm(self.attention(h, inputs))
        return h + self.mlp_out_norm(self.feed_forward(h, inputs))


def layer(model: ModelConfig, index: int) -> LayerChoice:
    return OLMo2Layer, {}
