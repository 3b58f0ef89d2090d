"""SiameseNorm, post_pre variant (the canonical form).

For each sublayer k (attention, then MLP) of global block l, with c_l = sqrt(2 (l + 1)):

    u = Npost_k(x)                          # post-norm of the Post-Norm-like stream
    r = F_k( Nin_k( u + Npre_k(y) ) )       # one branch output shared by both streams
    x = u + r / c_l
    y = y + r

Three norms per sublayer (``attn_norms``, ``mlp_norms``); block 0 starts x = y = embedding,
and the final merge Nfinal(Na(x) + Nb(y)) closes the decoder (``model.layers.merge``).
Ablations: ``siamese_input_norm = false`` makes Nin the identity, ``siamese_depth_constant =
false`` sets c_l = 1.

Where fusion happens (triton backend; the torch backend runs the same steps unfused): the
attention entry is one pass, which stores no u (the MLP entry computes u = Npost(x) from the
layer input's x, forward and backward); the attention's update and the MLP's entry are one
pass; the MLP's
update is one pass writing the packed output.
"""

from __future__ import annotations

import torch

from model.config import ModelConfig
from model.layers.base import BranchInputs, LayerChoice
from model.layers.two_stream import TwoStreamLayer, siamese_params


class SiameseLayer(TwoStreamLayer):
    def __init__(self, config, submodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.attn_norms = self.sublayer_norms(site="attention")
        self.mlp_norms = self.sublayer_norms()

    def compute(self, hidden_states: torch.Tensor, inputs: BranchInputs) -> torch.Tensor:
        # u = Npost(x), s = Nin(...); fused, u is not stored: the MLP entry computes it from x
        computed = self.mlp_norms.computes_u_from(self.attn_norms.post)
        x, y, u, s = self.enter(self.attn_norms, hidden_states, store_u=not computed)
        r = self.attention(s, inputs)
        # x = u + r/c, y += r; entry
        u, y, s = self.mlp_norms.update_entry(u, y, r, self.c_operand,
                                              (x, self.attn_norms.post))
        r = self.feed_forward(s, inputs)
        return self.streams_out(u, y, r)                          # x = u + r/c, y += r; packed


def layer(model: ModelConfig, index: int) -> LayerChoice:
    """Every block is a SiameseLayer."""
    return SiameseLayer, siamese_params(model)
