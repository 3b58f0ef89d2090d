"""SiameseNorm, hybrid_pre variant (the published language-model form).

The x stream follows HybridNorm (QKV-norm attention, Post-Norm around the MLP); y stays
Pre-Norm. For global block l, with c_l = sqrt(2 (l + 1)):

    attention:  a = x * g + Npre_attn(y)             # g: per-channel gate, init 1, fp32
                r = Attn(a)                          # per-head norms on Q, K, V
                x = x + r / c_l ;  y = y + r
    MLP:        u = Npost_mlp(x)                     # x is replaced by its normalised value
                r = MLP( Nin_mlp( u + Npre_mlp(y) ) )
                x = u + r / c_l ;  y = y + r

HybridNorm* (``hybrid_prenorm_first_block``): block 0 gives its attention a Pre-Norm input
norm, a = Nin_attn(x * g + Npre_attn(y)), and has no Npost_mlp, keeping x's residual intact.

Fusion (triton backend): the attention's update and the MLP's entry are one pass where the
block has Npost_mlp; the MLP's update is one pass writing the packed output. The gated
attention entry is no norm trio and stays plain torch.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.identity_op import IdentityOp

from kernels.norms import mark_sequence_parallel
from model.config import ModelConfig
from model.layers.base import BranchInputs, LayerChoice
from model.layers.two_stream import TwoStreamLayer, siamese_params


class ChannelGate(torch.nn.Module):
    """A learnable per-channel scale g, kept in fp32 whatever the parameter dtype."""

    def __init__(self, config, hidden_size: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=torch.float32))
        mark_sequence_parallel(self.weight, config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() * self.weight).to(x.dtype)


class SiameseHybridLayer(TwoStreamLayer):
    def __init__(self, config, submodules, *args, prenorm_first_block: bool = False, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        prenorm_block = prenorm_first_block and self.layer_number == 1
        self.attn_gate = ChannelGate(self.config, self.config.hidden_size)
        self.attn_pre_norm = self.build_norm()
        self.attn_in_norm = self.build_norm() if prenorm_block else IdentityOp()
        self.mlp_norms = self.sublayer_norms(post=not prenorm_block)

    def compute(self, hidden_states: torch.Tensor, inputs: BranchInputs) -> torch.Tensor:
        x, y = self.streams_in(hidden_states)
        a = self.attn_in_norm(self.attn_gate(x) + self.attn_pre_norm(y))
        r = self.attention(a, inputs)
        u, y, s = self.mlp_norms.update_entry(x, y, r, self.c)   # x = x + r/c, y += r; entry
        r = self.feed_forward(s, inputs)
        return self.streams_out(u, y, r)                          # x = u + r/c, y += r; packed


def layer(model: ModelConfig, index: int) -> LayerChoice:
    """Every block is a SiameseHybridLayer (block 0 is HybridNorm*'s with the flag)."""
    return SiameseHybridLayer, {**siamese_params(model),
                                "prenorm_first_block": model.hybrid_prenorm_first_block}
