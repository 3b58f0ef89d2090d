"""SiameseNorm, post_pre variant (the canonical form).

For each sublayer k of global block l, with c_l = sqrt(2 (l + 1)):

    u = Npost_k(x)                          # post-norm of the Post-Norm-like stream
    r = F_k( Nin_k( u + Npre_k(y) ) )       # one branch output shared by both streams
    x = u + r / c_l
    y = y + r

Three norms per sublayer. The final merge Nfinal(Na(x) + Nb(y)) is :class:`StreamMergeNorm`.
"""

from __future__ import annotations

from model.layers.base import TwoStreamLayer


class SiameseLayer(TwoStreamLayer):
    norm_names = (
        "attn_post_norm", "attn_pre_norm", "attn_in_norm",
        "mlp_post_norm", "mlp_pre_norm", "mlp_in_norm",
    )

    def branch_input(self, sublayer, hidden_states):
        x, y = self.split_streams(sublayer, hidden_states)
        u = getattr(self, f"{sublayer}_post_norm")(x)
        pre_y = getattr(self, f"{sublayer}_pre_norm")(y)
        return getattr(self, f"{sublayer}_in_norm")(u + pre_y), (u, y)

    def residual_update(self, sublayer, saved, branch_out):
        u, y = saved
        return self.dual_update(u, y, branch_out)
