"""Post-Norm (baseline): h <- N_k(h + F_k(h)) for k in (attn, mlp); no final norm."""

from __future__ import annotations

from model.layers.base import SchemeLayer


class PostNormLayer(SchemeLayer):
    norm_names = ("attn_post_norm", "mlp_post_norm")

    def branch_input(self, sublayer, hidden_states):
        return hidden_states, hidden_states

    def residual_update(self, sublayer, h, branch_out):
        return getattr(self, f"{sublayer}_post_norm")(h + branch_out)
