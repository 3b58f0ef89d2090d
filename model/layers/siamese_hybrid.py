"""SiameseNorm, hybrid_pre variant (the published language-model form).

The x stream follows HybridNorm (QKV-norm attention, Post-Norm around the MLP); y stays
Pre-Norm. For global block l, with c_l = sqrt(2 (l + 1)):

    attention:  a = x * g + Npre_attn(y)             # g: per-channel gate, init 1, fp32
                r = Attn(a)                          # per-head norms on Q, K, V
                x = x + r / c_l ;  y = y + r
    MLP:        x = Npost_mlp(x)                     # x is replaced by its normalised value
                r = MLP( Nin_mlp( x + Npre_mlp(y) ) )
                x = x + r / c_l ;  y = y + r

HybridNorm* (``hybrid_prenorm_first_block``): block 0 gives its attention a Pre-Norm input
norm, a = Nin_attn(x * g + Npre_attn(y)), and skips Npost_mlp, keeping x's residual intact.

The attention update and the MLP entry (Npost, Npre, Nin) run as one fused op from
``kernels.dispatch`` where the block has Npost; the gated attention entry and HybridNorm*'s
block 0 keep the plain composition.
"""

from __future__ import annotations

import torch

from kernels import dispatch
from kernels.norms import mark_sequence_parallel
from model.layers.base import TwoStreamLayer


class ChannelGate(torch.nn.Module):
    """A learnable per-channel scale g, kept in fp32 whatever the parameter dtype."""

    def __init__(self, config, hidden_size: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=torch.float32))
        mark_sequence_parallel(self.weight, config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() * self.weight).to(x.dtype)


class SiameseHybridLayer(TwoStreamLayer):
    norm_names = ("attn_pre_norm", "mlp_post_norm", "mlp_pre_norm", "mlp_in_norm")

    def __init__(self, config, submodules, *args, prenorm_first_block: bool = False, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.attn_gate = ChannelGate(self.config, self.config.hidden_size)
        self.prenorm_block = prenorm_first_block and self.layer_number == 1
        if self.prenorm_block:
            self.attn_in_norm = submodules.norm(
                config=self.config, hidden_size=self.config.hidden_size,
                eps=self.config.layernorm_epsilon,
            )
            del self.mlp_post_norm

    def branch_input(self, sublayer, hidden_states):
        if sublayer == "attn":  # the gate g is no norm: this entry stays the reference
            x, y = self.split_streams(sublayer, hidden_states)
            a = self.attn_gate(x) + self.attn_pre_norm(y)
            return (self.attn_in_norm(a) if self.prenorm_block else a), (x, y)
        # hidden_states is the attention's PendingUpdate.
        if self.prenorm_block:  # no Npost: nothing to fuse the update with
            x, y = self.apply_update(hidden_states)
            return self.mlp_in_norm(x + self.mlp_pre_norm(y)), (x, y)
        x, y, s = dispatch.siamese_update_entry(
            *hidden_states, self.depth_scale, self.mlp_post_norm, self.mlp_pre_norm,
            self.mlp_in_norm)
        return s, (x, y)
