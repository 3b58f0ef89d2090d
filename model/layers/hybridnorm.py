"""HybridNorm (baseline): QKV-norm attention and Post-Norm around the MLP, one stream.

For every block (the x-stream recipe of SiameseNorm's hybrid_pre, without y):

    attention:  h = h + Attn(h)          # no input norm; per-head norms on Q, K and V
    MLP:        u = Npost_mlp(h)         # h is replaced by its normalised value
                h = u + MLP(u)

The last block's output is not normalised, so a final norm closes the block: out = N_final(h).

HybridNorm* (``hybrid_prenorm_first_block``) makes block 0 a Pre-Norm block that keeps the
QKV-norm attention: h = h + Attn(N_attn(h)); h = h + MLP(N_mlp(h)). That block is megatron's
own Pre-Norm layer, chosen by the spec (``model.spec``), so this class has no special case.
"""

from __future__ import annotations

from model.layers.base import SchemeLayer


class HybridNormLayer(SchemeLayer):
    norm_names = ("mlp_post_norm",)

    def branch_input(self, sublayer, hidden_states):
        if sublayer == "mlp":
            hidden_states = self.mlp_post_norm(hidden_states)
        return hidden_states, hidden_states

    def residual_update(self, sublayer, h, branch_out):
        return h + branch_out
