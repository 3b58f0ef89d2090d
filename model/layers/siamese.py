"""SiameseNorm, post_pre variant (the canonical form).

For each sublayer k of global block l, with c_l = sqrt(2 (l + 1)):

    u = Npost_k(x)                          # post-norm of the Post-Norm-like stream
    r = F_k( Nin_k( u + Npre_k(y) ) )       # one branch output shared by both streams
    x = u + r / c_l
    y = y + r

Three norms per sublayer. The final merge Nfinal(Na(x) + Nb(y)) is :class:`StreamMergeNorm`.
The math lives in ``kernels.dispatch`` (a torch reference and fused kernels): the attention's
entry, the attention update fused with the MLP's entry, and the MLP update into the packed
output.
"""

from __future__ import annotations

from kernels import dispatch
from model.layers.base import TwoStreamLayer


class SiameseLayer(TwoStreamLayer):
    norm_names = (
        "attn_post_norm", "attn_pre_norm", "attn_in_norm",
        "mlp_post_norm", "mlp_pre_norm", "mlp_in_norm",
    )

    def branch_input(self, sublayer, hidden_states):
        norms = [getattr(self, f"{sublayer}_{n}_norm") for n in ("post", "pre", "in")]
        if sublayer == "attn":
            x, y = self.split_streams(sublayer, hidden_states)
            u, s = dispatch.siamese_entry(x, y, *norms)
        else:  # hidden_states is the attention's PendingUpdate, applied with the MLP's norms
            u, y, s = dispatch.siamese_update_entry(*hidden_states, self.depth_scale, *norms)
        return s, (u, y)
