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
from model.layers.base import LayerChoice
from model.layers.post import PostNormLayer


class DeepNormLayer(PostNormLayer):
    """PostNormLayer's compute with alpha = (2 L)^(1/4)."""

    def __init__(self, config, submodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.alpha = (2.0 * self.config.num_layers) ** 0.25  # the whole model's L, every stage


def scale_init(model: ModelConfig, key: str, weight: torch.Tensor) -> None:
    """DeepNet's initialisation, applied by ``model.init`` to each freshly drawn global weight.

    DeepNet draws Xavier-normal weights and gives fc1, fc2, V and the output projection gain
    beta. Here every matrix starts from the model's normal(0, init_method_std) (close to Xavier
    at usual widths) and those four are multiplied by beta. megatron's extra 1/sqrt(2 L) on
    output projections is not used for this scheme (``Traits.depth_scaled_output_init``): beta
    is DeepNorm's depth scaling, and applying both would shrink fc2 and the output projection
    twice. Q and K keep gain 1.
    """
    beta = (8.0 * model.num_layers) ** -0.25
    if key.endswith(("linear_fc1.weight", "linear_fc2.weight", "linear_proj.weight")):
        weight.mul_(beta)
    elif key.endswith("linear_qkv.weight"):
        # megatron's fused QKV rows, per K/V group: its query heads, one key, one value head.
        per_group = model.num_attention_heads // model.kv_heads
        head_dim = model.hidden_size // model.num_attention_heads
        weight.view(model.kv_heads, per_group + 2, head_dim, -1)[:, -1].mul_(beta)


def layer(model: ModelConfig, index: int) -> LayerChoice:
    return DeepNormLayer, {}
