"""Residual scheme -> megatron-core block spec: which layer class, which norms, which merge.

Variants are chosen here, by spec, never by branches inside a forward pass. ``pre`` is
megatron's stock TransformerLayer so single-stream Pre-Norm pays nothing for the framework.
Each block's spec is chosen from its global index, so schemes whose blocks differ (Mix-LN's
Post-Norm blocks, HybridNorm*'s Pre-Norm block 0) split the same way on every pipeline layout.
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
    get_transformer_layer_offset,
)

from kernels import dispatch
from kernels.norms import Norm
from model.attention import QKVNormSelfAttention
from model.backends import (
    AttentionBackend,
    TransformerImpl,
    resolve_attention_backend,
    resolve_transformer_impl,
    te_module,
)
from model.config import ModelConfig
from model.layers.base import SchemeLayerSubmodules
from model.layers.deepnorm import DeepNormLayer
from model.layers.hybridnorm import HybridNormLayer
from model.layers.merge import StreamMergeNorm
from model.layers.mixln import is_post_norm_block
from model.layers.post import PostNormLayer
from model.layers.siamese import SiameseLayer
from model.layers.siamese_hybrid import SiameseHybridLayer
from model.schemes import ResidualScheme
from model.sdpa_attention import SDPAttention


def plain_norm():
    """The class of every norm in the spec: megatron's ``TENorm`` (Transformer Engine's RMSNorm
    or LayerNorm, which tags its own weights for sequence parallelism) when the norm backend is
    ``te``, else :class:`~kernels.norms.Norm`, whose math ``kernels.dispatch`` picks (torch or
    Triton). Both take megatron's norm arguments and keep ``weight``/``bias`` names, so a
    checkpoint does not depend on the choice. The fused two-stream ops run their reference
    composition over TE modules (TE has no two-stream fusion)."""
    if dispatch.active_backend() is dispatch.NormBackend.TE:
        return te_module("TENorm")
    return Norm


def linear_modules(model: ModelConfig) -> dict:
    """The linear-layer classes for ``model.transformer_impl``: megatron's, or Transformer
    Engine's plus its fused norm+linear (``norm_column``; None where there is none). TE is looked
    up only when chosen, and choosing it is only valid with CUDA (``model.backends``)."""
    if resolve_transformer_impl(model.transformer_impl) is TransformerImpl.TE:
        return {"column": te_module("TEColumnParallelLinear"),
                "row": te_module("TERowParallelLinear"),
                "norm_column": te_module("TELayerNormColumnParallelLinear")}
    return {"column": ColumnParallelLinear, "row": RowParallelLinear, "norm_column": None}


def core_attention(model: ModelConfig):
    """The core-attention class for ``model.attention_backend``."""
    backend = resolve_attention_backend(model.attention_backend)
    if backend is AttentionBackend.TE:
        return te_module("TEDotProductAttention")
    return SDPAttention if backend is AttentionBackend.SDPA else DotProductAttention


def attention_spec(model: ModelConfig, fuse_input_norm: bool = False) -> ModuleSpec:
    """Self-attention (with per-head Q/K/V norms for QKV-norm schemes). ``fuse_input_norm``:
    the QKV projection applies the block's input norm itself (the layer's must be IdentityOp)."""
    qkv_norm = model.residual_scheme.qkv_norm
    head_norm = plain_norm() if qkv_norm else IdentityOp
    linears = linear_modules(model)
    return ModuleSpec(
        module=QKVNormSelfAttention if qkv_norm else SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=linears["norm_column"] if fuse_input_norm else linears["column"],
            core_attention=core_attention(model),
            linear_proj=linears["row"],
            q_layernorm=head_norm,
            k_layernorm=head_norm,
        ),
    )


def mlp_spec(model: ModelConfig, fuse_input_norm: bool = False):
    linears = linear_modules(model)
    fc1 = linears["norm_column"] if fuse_input_norm else linears["column"]
    return partial(
        MLP.as_mlp_submodule,
        submodules=MLPSubmodules(linear_fc1=fc1, linear_fc2=linears["row"]),
    )


# Checkpoint names of the unfused Pre-Norm layer's norms, mapped to TE's fused names (megatron's
# own convention), so a checkpoint of one variant loads into the other.
_FUSED_NORM_KEYS = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}


def pre_norm_layer_spec(model: ModelConfig) -> ModuleSpec:
    """megatron's own Pre-Norm TransformerLayer. With TE linears its input and pre-MLP norms are
    fused into the QKV and fc1 projections (TE's LayerNormLinear), as in megatron's TE spec."""
    fused = linear_modules(model)["norm_column"] is not None
    norm = IdentityOp if fused else plain_norm()
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm, self_attention=attention_spec(model, fuse_input_norm=fused),
            self_attn_bda=get_bias_dropout_add, pre_mlp_layernorm=norm,
            mlp=mlp_spec(model, fuse_input_norm=fused), mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={} if fused else dict(_FUSED_NORM_KEYS),
        ),
    )


def is_pre_norm_block(model: ModelConfig, index: int) -> bool:
    """Whether global block ``index`` is megatron's Pre-Norm layer: every ``pre`` block, Mix-LN's
    blocks above its split, and HybridNorm*'s block 0 (with QKV-norm attention)."""
    scheme = model.residual_scheme
    if scheme is ResidualScheme.MIXLN:
        return not is_post_norm_block(index, model.num_layers, model.mixln_post_ratio)
    if scheme is ResidualScheme.HYBRIDNORM:
        return model.hybrid_prenorm_first_block and index == 0
    return scheme is ResidualScheme.PRE


def layer_spec(model: ModelConfig, index: int) -> ModuleSpec:
    """The spec of global block ``index`` (0-based)."""
    scheme = model.residual_scheme
    if is_pre_norm_block(model, index):
        return pre_norm_layer_spec(model)
    attention, mlp = attention_spec(model), mlp_spec(model)
    siamese = {"depth_constant": model.siamese_depth_constant}
    layer_class, params = {
        ResidualScheme.POST: (PostNormLayer, {}),
        ResidualScheme.MIXLN: (PostNormLayer, {}),  # blocks below the split
        ResidualScheme.DEEPNORM: (DeepNormLayer, {}),
        ResidualScheme.HYBRIDNORM: (HybridNormLayer, {}),
        ResidualScheme.SIAMESE: (SiameseLayer, siamese),
        ResidualScheme.SIAMESE_HYBRID: (
            SiameseHybridLayer,
            {**siamese, "prenorm_first_block": model.hybrid_prenorm_first_block},
        ),
    }[scheme]
    # The ablation without Nin: the input norms become identities (absent names are ignored).
    dropped = {} if model.siamese_input_norm else dict.fromkeys(
        ("attn_in_norm", "mlp_in_norm"), IdentityOp)
    return ModuleSpec(
        module=layer_class,
        params=params,
        submodules=SchemeLayerSubmodules(
            self_attention=attention, mlp=mlp, norm=plain_norm(), norm_overrides=dropped
        ),
    )


def final_norm(scheme: ResidualScheme):
    """What closes the block: the stream merge, nothing when every block ends in a norm
    (Post-Norm, DeepNorm), else a plain norm (Pre-Norm, HybridNorm, Mix-LN)."""
    if scheme.two_stream:
        return partial(StreamMergeNorm, norm=plain_norm())
    return None if scheme.ends_normalized else plain_norm()


def block_spec(model: ModelConfig, config, vp_stage: int | None, pp_rank: int):
    """The blocks this pipeline stage (and virtual stage) builds, each from its global index."""
    layers = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(
        layer_specs=[layer_spec(model, offset + i) for i in range(layers)],
        layer_norm=final_norm(model.residual_scheme),
    )
