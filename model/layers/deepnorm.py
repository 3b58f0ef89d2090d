"""DeepNorm (DeepNet, baseline): Post-Norm with the skip scaled up and the branches scaled down.

For each sublayer k of every block, with L = num_layers (a decoder-only model of L blocks):

    h = N_k(alpha * h + F_k(h))         alpha = (2 L)^(1/4)

and, at initialisation, the weights DeepNet names (the MLP's fc1 and fc2, the value and the
attention output projections) are multiplied by beta = (8 L)^(-1/4); Q and K keep gain 1.
No final norm: every block already ends in one.
"""

from __future__ import annotations

import torch

from model.config import ModelConfig
from model.layers.base import BranchInputs, LayerChoice
from model.layers.post import PostNormLayer


class DeepNormLayer(PostNormLayer):
    def __init__(self, config, submodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        num_layers = self.config.num_layers  # the whole model's, on every pipeline stage
        self.alpha = (2.0 * num_layers) ** 0.25
        self.scale_branch_init((8.0 * num_layers) ** -0.25)

    def compute(self, h: torch.Tensor, inputs: BranchInputs) -> torch.Tensor:
        h = self.attn_post_norm(self.alpha * h + self.attention(h, inputs))
        return self.mlp_post_norm(self.alpha * h + self.feed_forward(h, inputs))

    @torch.no_grad()
    def scale_branch_init(self, beta: float) -> None:
        """DeepNet's initialisation, applied once to the weights megatron just drew.

        DeepNet draws Xavier-normal weights and gives fc1, fc2, V and the output projection
        gain beta. Here every matrix starts from the model's normal(0, init_method_std) (close
        to Xavier at usual widths) and those four are multiplied by beta. megatron's extra
        1/sqrt(2 L) on output projections is not used for this scheme (see
        ``Traits.depth_scaled_output_init``): beta is DeepNorm's depth scaling, and
        applying both would shrink fc2 and the output projection twice. Only the local shard
        is touched: the V rows of a shard are the V rows of its own K/V groups, so every TP
        layout scales the same entries.
        """
        for linear in (self.mlp.linear_fc1, self.mlp.linear_fc2, self.self_attention.linear_proj):
            linear.weight.mul_(beta)
        # megatron's fused QKV rows, per K/V group: its query heads, one key head, one value head.
        qkv = self.self_attention.linear_qkv.weight
        heads_per_group = self.config.num_attention_heads // self.config.num_query_groups
        groups = qkv.view(-1, heads_per_group + 2, self.config.kv_channels, qkv.shape[-1])
        groups[:, -1].mul_(beta)


def layer(model: ModelConfig, index: int) -> LayerChoice:
    return DeepNormLayer, {}
