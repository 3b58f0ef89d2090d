"""Peri-LN (Kim et al. 2025; Gemma 2's "sandwich" norm): a norm on each sublayer's input and
on its output, the residual stream itself never normalised.

For each sublayer k in (attn, mlp) of every block:

    h = h + Nout_k(F_k(Nin_k(h)))

The stream grows un-normalised as in Pre-Norm, so a final norm closes the decoder. Every norm
starts at weight 1; the weights start as the model's ``init`` draws them.
"""

from __future__ import annotations

import torch

from model.config import ModelConfig
from model.layers.base import BranchInputs, LayerChoice, SchemeLayer


class PeriLNLayer(SchemeLayer):
    def __init__(self, config, submodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.attn_in_norm = self.build_norm(site="attention")
        self.attn_out_norm = self.build_norm(site="attention")
        self.mlp_in_norm = self.build_norm()
        self.mlp_out_norm = self.build_norm()

    def compute(self, h: torch.Tensor, inputs: BranchInputs) -> torch.Tensor:
        h = h + self.attn_out_norm(self.attention(self.attn_in_norm(h), inputs))
        return h + self.mlp_out_norm(self.feed_forward(self.mlp_in_norm(h), inputs))


def layer(model: ModelConfig, index: int) -> LayerChoice:
    return PeriLNLayer, {}
