"""Residual scheme -> megatron-core block spec: which layer class, which norms, which merge.

Variants are chosen here, by spec, never by branches inside a forward pass. ``pre`` is
megatron's stock TransformerLayer so single-stream Pre-Norm pays nothing for the framework.
"""

from __future__ import annotations

from functools import partial

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
)

from kernels.norms import Norm
from model.attention import QKVNormSelfAttention
from model.config import ModelConfig
from model.layers.base import SchemeLayerSubmodules
from model.layers.merge import StreamMergeNorm
from model.layers.post import PostNormLayer
from model.layers.siamese import SiameseLayer
from model.layers.siamese_hybrid import SiameseHybridLayer
from model.schemes import ResidualScheme


def attention_spec(qkv_norm: bool) -> ModuleSpec:
    head_norm = Norm if qkv_norm else IdentityOp
    return ModuleSpec(
        module=QKVNormSelfAttention if qkv_norm else SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear,
            core_attention=DotProductAttention,
            linear_proj=RowParallelLinear,
            q_layernorm=head_norm,
            k_layernorm=head_norm,
        ),
    )


def mlp_spec():
    return partial(
        MLP.as_mlp_submodule,
        submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
    )


def layer_spec(model: ModelConfig) -> ModuleSpec:
    scheme = model.residual_scheme
    attention, mlp = attention_spec(scheme.qkv_norm), mlp_spec()
    if scheme is ResidualScheme.PRE:
        return ModuleSpec(
            module=TransformerLayer,
            submodules=TransformerLayerSubmodules(
                input_layernorm=Norm, self_attention=attention,
                self_attn_bda=get_bias_dropout_add, pre_mlp_layernorm=Norm, mlp=mlp,
                mlp_bda=get_bias_dropout_add,
            ),
        )
    layer_class, params = {
        ResidualScheme.POST: (PostNormLayer, {}),
        ResidualScheme.SIAMESE: (SiameseLayer, {}),
        ResidualScheme.SIAMESE_HYBRID: (
            SiameseHybridLayer, {"prenorm_first_block": model.hybrid_prenorm_first_block}
        ),
    }[scheme]
    return ModuleSpec(
        module=layer_class,
        params=params,
        submodules=SchemeLayerSubmodules(self_attention=attention, mlp=mlp, norm=Norm),
    )


def final_norm(scheme: ResidualScheme):
    """What closes the block: the stream merge, a plain norm (Pre-Norm) or nothing (Post-Norm,
    whose last sublayer already ends in a norm)."""
    if scheme.two_stream:
        return partial(StreamMergeNorm, norm=Norm)
    return None if scheme is ResidualScheme.POST else Norm


def block_spec(model: ModelConfig, config, vp_stage: int | None, pp_rank: int):
    layers = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(
        layer_specs=[layer_spec(model)] * layers, layer_norm=final_norm(model.residual_scheme)
    )
